"""Token ids as the engine sees them, for one output head: the checkpoint's ids, or (audio
head) the same ids rotated so that the ids Orpheus can emit come first.

The one place that knows the mapping (:mod:`llm_worker.engine.output_head` explains the head and
chooses it). The worker converts at the engine's boundary (prompts in, sampled ids out, the
stop id); the code vLLM loads into its own processes, the audio head's model class and the
logits processors, learns the space from the engine's configuration
(:func:`engine_token_space`). Import-light (numpy): it is loaded in every vLLM process.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llm_worker.vllm_ext import tokens as T

AUDIO_HEAD_ARCHITECTURE = "OrpheusAudioHeadForCausalLM"
"""The model class of the audio head, registered with vLLM by :mod:`llm_worker.vllm_ext.plugin`."""
FIRST_EMITTABLE = T.CUSTOM_TOKEN_BASE
"""The first id Orpheus can emit; the audio head keeps every id from here to the end."""


class HeadKind(enum.StrEnum):
    FULL = "full"
    AUDIO = "audio"


class CheckpointLayoutError(ValueError):
    """The checkpoint is not laid out as Orpheus: serving it would produce garbage."""


@dataclass(frozen=True)
class TokenSpace:
    """Token ids as the engine sees them, for one output head."""

    kind: HeadKind
    vocab: int
    """The checkpoint's vocabulary size (``config.json`` ``vocab_size``)."""

    @classmethod
    def full(cls, vocab: int = T.VOCAB_SIZE) -> TokenSpace:
        return cls(HeadKind.FULL, vocab)

    @classmethod
    def audio(cls, vocab: int) -> TokenSpace:
        if vocab < T.AUDIO_TOKEN_END:
            raise CheckpointLayoutError(
                f"vocab_size {vocab} has no room for Orpheus's audio ids (up to {T.AUDIO_TOKEN_END})"
            )
        return cls(HeadKind.AUDIO, vocab)

    @property
    def offset(self) -> int:
        """What is subtracted (mod vocab) from a checkpoint id to get its engine id."""
        return FIRST_EMITTABLE if self.kind is HeadKind.AUDIO else 0

    @property
    def width(self) -> int:
        """Logits columns: the engine ids that can be sampled are ``0 .. width-1``."""
        return self.vocab - self.offset

    def engine_id(self, token: int) -> int:
        return (token - self.offset) % self.vocab

    @property
    def end_of_speech(self) -> int:
        return self.engine_id(T.END_OF_SPEECH)

    @property
    def start_of_speech(self) -> int:
        return self.engine_id(T.START_OF_SPEECH)

    @property
    def audio_token_base(self) -> int:
        return self.engine_id(T.AUDIO_TOKEN_BASE)

    def to_engine(self, ids: Sequence[int]) -> list[int]:
        """A prompt's checkpoint ids as engine ids (one vectorised op; identity on full)."""
        if not self.offset:
            return list(ids)
        a = np.asarray(ids, dtype=np.int64)
        a -= self.offset
        np.remainder(a, self.vocab, out=a)
        return a.tolist()

    def from_engine_(self, ids: np.ndarray) -> np.ndarray:
        """Sampled engine ids back to checkpoint ids, in place (int64; identity on full).

        Sampled ids are below ``width``, so this is one add; ids a prompt carried (text)
        wrap around as well."""
        if self.offset:
            ids += self.offset
            ids[ids >= self.vocab] -= self.vocab
        return ids


def engine_token_space(vllm_config: Any) -> TokenSpace:
    """The token space of a built engine (in the engine core: the logits processors)."""
    mc = vllm_config.model_config
    vocab = int(mc.get_vocab_size())
    if AUDIO_HEAD_ARCHITECTURE in (mc.architectures or ()):
        return TokenSpace.audio(vocab)
    return TokenSpace.full(vocab)
