"""The audio-only output head: vLLM's Llama with its vocabulary rotated and its head sliced.

Selected with ``hf_overrides={"architectures": ["OrpheusAudioHeadForCausalLM"]}``
(:meth:`llm_worker.engine.output_head.HeadChoice.hf_overrides`) and registered with vLLM's model
registry by the ``vllm.general_plugins`` entry point (:mod:`llm_worker.vllm_ext.plugin`), which
vLLM loads in every process, the engine core included.

Engine ids are the checkpoint's rotated (:mod:`llm_worker.engine.output_head`): ``engine = (id -
128256) mod vocab``. At load time this class rotates the embedding rows the same way (the
head is tied to the embedding in Orpheus; an untied head is rotated too), so

- the embedding lookup of engine id ``r`` is the checkpoint's embedding of the original id:
  no per-step work on the input side;
- the logits of the emittable ids are the product with the first ``width`` rows, a
  contiguous view of the same weight (no copy), projected by vLLM's own
  ``LogitsProcessor`` (its platform GEMM dispatch, head dtype, scale) with ``vocab_size =
  width``. Each logit is the same dot product as the full head's.

The projection lives in ``audio_logits``/``audio_head``, not in ``logits_processor``/
``lm_head``: vLLM's LoRA manager wraps those two for adapters that target the LM head, and
such adapters are refused at load with the audio head (:mod:`llm_worker.voices.lora`). Nor is it
a draft model for speculative decoding (vLLM's local-argmax path reads ``lm_head``): the
server runs none.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
from vllm.model_executor.models.llama import LlamaForCausalLM

from llm_worker.vllm_ext.token_space import TokenSpace


class HeadRows(nn.Module):
    """The first ``rows`` rows of an LM head, as a layer vLLM's ``LogitsProcessor`` takes.

    ``weight`` is a view of the head's weight (a plain tensor attribute, not a parameter:
    nothing to load, nothing counted twice). ``quant_method`` is the head's, so the loader's
    ``process_weights_after_loading`` prepares it as it prepares the head (the CPU GEMM
    prepack); the view is taken at that point, after the rows were rotated.
    """

    def __init__(self, head: nn.Module, rows: int) -> None:
        super().__init__()
        self._head = [head]  # a list: not a submodule (its parameters are the model's)
        self.rows = rows
        self.quant_method = head.quant_method
        self.tp_size = 1
        self.weight = head.weight.data[:rows]

    def refresh(self) -> None:
        self.weight = self._head[0].weight.data[: self.rows]


class OrpheusAudioHeadForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        config = vllm_config.model_config.hf_config
        tp = vllm_config.parallel_config.tensor_parallel_size
        pp = vllm_config.parallel_config.pipeline_parallel_size
        if tp != 1 or pp != 1:
            raise ValueError(
                f"the audio output head runs with tensor and pipeline parallelism 1 (have "
                f"{tp}, {pp}): set llm.output_head = full"
            )
        if not isinstance(self.lm_head.quant_method, UnquantizedEmbeddingMethod):
            raise ValueError(
                f"the audio output head needs an unquantized LM head (this one is "
                f"{type(self.lm_head.quant_method).__name__}): set llm.output_head = full"
            )
        self.space = TokenSpace.audio(int(config.vocab_size))
        self.tied = self.lm_head.weight is self.model.embed_tokens.weight
        self.audio_head = HeadRows(self.lm_head, self.space.width)
        self.audio_logits = LogitsProcessor(
            self.space.width, scale=getattr(config, "logit_scale", 1.0)
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.audio_logits(self.audio_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        self._rotate_rows()
        return loaded

    @torch.no_grad()
    def _rotate_rows(self) -> None:
        """Rotate the vocabulary rows to engine order (in place; once, at load time)."""
        vocab, shift = self.space.vocab, self.space.offset
        heads = [self.model.embed_tokens.weight]
        if not self.tied:
            heads.append(self.lm_head.weight)
        for w in heads:
            # Rows past ``vocab`` are the layer's padding: they stay where they are. One
            # temporary copy of the table at load time (before vLLM measures memory).
            rows = w.data[:vocab]
            rows.copy_(torch.roll(rows, -shift, dims=0))
        self.audio_head.refresh()
