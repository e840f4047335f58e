"""Orpheus prompt token ids (docs/orpheus.md, "The prompt"), for built-in and custom voices.

``START_OF_HUMAN``, the Llama-3 tokenization of ``"{voice}: {text}"`` (beginning with BOS),
``END_OF_TEXT``, ``END_OF_HUMAN``, ``START_OF_AI``, ``START_OF_SPEECH``.

The text is the user's: special-token names in it (``<|eot_id|>``, ``<custom_token_3>``)
are tokenized as plain text, never as control ids, so no input can forge a prompt
boundary or an audio token. Emotion tags (``<laugh>``) are plain text to the model too.

A custom (zero-shot) voice is a previous turn: its reference transcript and the reference
audio's codes, then the text to speak, with no voice name::

    START_OF_HUMAN, ref_text, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH,
    ref_audio_tokens, END_OF_SPEECH, END_OF_AI,
    START_OF_HUMAN, target_text, END_OF_TEXT, END_OF_HUMAN, START_OF_AI, START_OF_SPEECH

Texts are tokenized as for a built-in voice (BOS first, as Orpheus's own zero-shot example
does); the audio tokens are the frames' ids exactly as the model emits them
(:func:`llm_worker.codes.frames_to_tokens`). The first line and a half are the same for
every request with the voice: vLLM's prefix cache keeps them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from llm_worker.codes import frames_to_tokens
from llm_worker.model_info import find_model_file
from llm_worker.vllm_ext import tokens as T


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        # Special-token names in user text are encoded as text (see module docstring).
        self._tok.encode_special_tokens = True
        bos = self._tok.id_to_token(T.BOS)
        if bos is None or self._tok.token_to_id(bos) != T.BOS:
            raise ValueError(f"tokenizer has no BOS at id {T.BOS}: not a Llama-3 tokenizer")

    @classmethod
    def from_pretrained(cls, name_or_path: str) -> PromptBuilder:
        """Load ``tokenizer.json`` from a checkpoint directory or the local hub cache."""
        path = find_model_file(name_or_path, "tokenizer.json")
        if path is None:
            raise FileNotFoundError(
                f"no tokenizer.json for {name_or_path!r} (a local directory, or a hub name "
                "already in the local cache)"
            )
        return cls(Tokenizer.from_file(str(Path(path))))

    def _wrap(self, ids: list[int]) -> list[int]:
        body = ids if ids and ids[0] == T.BOS else [T.BOS, *ids]
        return [*T.PROMPT_PREFIX, *body, *T.PROMPT_SUFFIX]

    def build(self, voice: str, text: str) -> list[int]:
        """Prompt ids for one piece of text spoken by ``voice``."""
        return self._wrap(self._tok.encode(f"{voice}: {text}", add_special_tokens=True).ids)

    def build_reference(self, transcript: str, frames: np.ndarray) -> list[int]:
        """The prefix of a custom voice: its reference turn (transcript, then the audio)."""
        text = self._wrap(self._tok.encode(transcript, add_special_tokens=True).ids)
        audio = frames_to_tokens(frames).tolist()
        return [*text, *audio, T.END_OF_SPEECH, T.END_OF_AI]

    def build_plain(self, text: str) -> list[int]:
        """The turn that follows a custom voice's prefix: the text alone, no voice name."""
        return self._wrap(self._tok.encode(text, add_special_tokens=True).ids)

    def build_many(self, voice: str, texts: list[str]) -> list[list[int]]:
        """Prompt ids for several pieces (one batched tokenizer call)."""
        encs = self._tok.encode_batch([f"{voice}: {t}" for t in texts], add_special_tokens=True)
        return [self._wrap(e.ids) for e in encs]
