"""The engine's output head (``llm.output_head``) and the token ids it implies.

Orpheus only ever emits ids from ``<custom_token_0>`` (128256) on: the special tokens of the
prompt/speech protocol and the 28,672-id audio block (docs/orpheus.md). With the **audio
head** the engine computes logits for those 28,684 ids only (the checkpoint's vocabulary is
156,940), so the LM head's matmul, the float32 logits copy, the penalties, temperature,
top-p and our audio-token constraint all run over ~5.5x fewer columns.

Every vLLM sampling path takes its width from ``logits.shape``, and a token id is a logits
column, so the engine must see the emittable ids first. Engine ids are the checkpoint's ids
**rotated**::

    engine = (id - 128256) mod vocab        id = (engine + 128256) mod vocab

so that the emittable ids are engine ids ``0 .. width-1`` (end-of-speech 128258 is 2, the
first audio id 128266 is 10) and text ids follow from ``width`` on. The model class
(:mod:`llm_worker.vllm_ext.audio_head_model`) rotates the embedding rows the same way at load time, so
the embedding lookup of an engine id is the checkpoint's embedding of the original id, and
its head is the first ``width`` rows: a contiguous slice, no copy.

This module is the one place that knows the mapping. The worker converts at the engine's
boundary: prompts on the way in (:meth:`TokenSpace.to_engine`, in
:class:`llm_worker.engine.engine.GenerationEngine`), sampled ids on the way out (one vectorised add
where tokens become codes, :meth:`TokenSpace.from_engine_`), and the stop id of the
sampling parameters (:attr:`TokenSpace.end_of_speech`). The logits processors in the engine
core learn the space from the engine's configuration (:func:`engine_token_space`).

What changes for speech: nothing (greedy generation is identical, tested); text tokens can
no longer be sampled, which is right for a speech model whose every step must be audio or
end-of-speech. The head needs a Llama checkpoint with Orpheus's vocabulary and tensor
parallelism 1; on vLLM's legacy (V1) runner it needs our tensor repetition penalty
(``llm.tensor_penalties``), because vLLM's own V1 penalty counts prompt ids into a table as
wide as the logits (text ids would fall outside it).

Import-light (json, numpy): the engine core's processors, benchmarks and tests use it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from llm_worker.model_info import find_model_file
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.token_space import (
    AUDIO_HEAD_ARCHITECTURE,
    CheckpointLayoutError,
    HeadKind,
    TokenSpace,
)

BASE_ARCHITECTURE = "LlamaForCausalLM"
"""The architecture the audio head subclasses: Orpheus checkpoints declare it."""
PLUGIN_GROUP = "vllm.general_plugins"
PLUGIN_NAME = "orpheus_serve"
"""The entry point (pyproject.toml) that registers the model class; what ``VLLM_PLUGINS``
must name when an operator sets it."""
PLUGIN_TARGET = "llm_worker.vllm_ext.plugin:register"
HEAD_CHOICES = ("auto", "audio", "full")


@dataclass(frozen=True)
class HeadChoice:
    space: TokenSpace
    reason: str

    def hf_overrides(self) -> dict[str, Any] | None:
        """vLLM ``hf_overrides`` that select the head's model class (None: the checkpoint's)."""
        if self.space.kind is HeadKind.AUDIO:
            return {"architectures": [AUDIO_HEAD_ARCHITECTURE]}
        return None

    def describe(self) -> str:
        s = self.space
        return f"{s.kind} ({s.width:,} of {s.vocab:,} logits columns; {self.reason})"


@dataclass(frozen=True)
class CheckpointLayout:
    """What ``config.json`` says, as far as the output head cares."""

    architectures: tuple[str, ...]
    vocab: int
    tied: bool


def read_layout(model: str) -> CheckpointLayout | None:
    """The checkpoint's layout from its ``config.json`` (None: not available locally).

    Raises :class:`CheckpointLayoutError` for a checkpoint Orpheus's token ids cannot be
    served from (no audio ids), whatever the head."""
    path = find_model_file(model, "config.json")
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text())
        vocab = int(cfg["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointLayoutError(f"{path}: no readable vocab_size ({e})") from None
    if vocab < T.AUDIO_TOKEN_END:
        raise CheckpointLayoutError(
            f"{model}: vocab_size {vocab} has no Orpheus audio ids (they end at "
            f"{T.AUDIO_TOKEN_END}): not an Orpheus checkpoint"
        )
    archs = tuple(cfg.get("architectures") or ())
    return CheckpointLayout(archs, vocab, bool(cfg.get("tie_word_embeddings", False)))


def choose_output_head(
    setting: str,
    model: str,
    *,
    v1_runner: bool,
    tensor_penalty: bool,
    tensor_parallel: int = 1,
) -> HeadChoice:
    """The head for ``llm.output_head = setting``.

    ``auto`` takes the audio head wherever it is supported and says why not otherwise;
    ``audio`` where it is not supported is a ValueError (one line: a permanent error).
    """
    if setting not in HEAD_CHOICES:
        raise ValueError(f"llm.output_head must be one of {HEAD_CHOICES}, not {setting!r}")
    layout = read_layout(model)
    if setting == "full":
        return HeadChoice(TokenSpace.full(layout.vocab if layout else T.VOCAB_SIZE), "configured")
    why_not = _unsupported(layout, v1_runner, tensor_penalty, tensor_parallel)
    if why_not is None:
        assert layout is not None
        why = "configured" if setting == "audio" else "auto"
        return HeadChoice(TokenSpace.audio(layout.vocab), why)
    if setting == "audio":
        raise ValueError(f"llm.output_head = audio is not supported here: {why_not}")
    vocab = layout.vocab if layout else T.VOCAB_SIZE
    return HeadChoice(TokenSpace.full(vocab), f"auto: {why_not}")


def _unsupported(
    layout: CheckpointLayout | None, v1_runner: bool, tensor_penalty: bool, tp: int
) -> str | None:
    if layout is None:
        return "the checkpoint's config.json is not available locally to check its layout"
    if layout.architectures != (BASE_ARCHITECTURE,):
        return f"the checkpoint is {list(layout.architectures)}, the audio head is a {BASE_ARCHITECTURE}"
    if tp != 1:
        return "the audio head runs with tensor parallelism 1"
    if v1_runner and not tensor_penalty:
        return (
            "vLLM's V1 repetition penalty counts prompt ids over the logits' width: "
            "set llm.tensor_penalties = true"
        )
    return plugin_problem()


def plugin_problem() -> str | None:
    """Why vLLM would not know the audio head's model class (None: it will)."""
    from importlib.metadata import entry_points

    if not any(ep.value == PLUGIN_TARGET for ep in entry_points(group=PLUGIN_GROUP)):
        return (
            f"this package's {PLUGIN_GROUP} entry point is not installed "
            "(pip install the project, e.g. `make install`)"
        )
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_NAME not in [p.strip() for p in allowed.split(",")]:
        return f"VLLM_PLUGINS={allowed!r} does not name {PLUGIN_NAME}"
    return None
