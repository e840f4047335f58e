"""The audio-token constraint for vLLM's V2 model runner (its own processor interface).

The V2 runner keeps request state on the device per persistent slot and hands each
step's layout to processors, so this version needs no host bookkeeping at all: the
sampled token's position is ``pos + 1``, its audio position ``pos + 1 - prompt_len``,
and a row's sample is kept (not a partial prefill chunk) iff ``pos + 1 >= prefill_len``.
Per-request constants are written into device tensors by scalar fills at admission (no
host-to-device copy, no sync). Same mask and the same count as the V1 processor
(:mod:`llm_worker.vllm_ext.sampling.constraint`); under speculative decoding, draft rows are
constrained and counted like any other row.

The repetition penalty has no V2 counterpart here: V2 already keeps penalty state on
the device per slot, so requests use vLLM's own ``repetition_penalty``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

from llm_worker.vllm_ext.sampling.args import RequestArgs
from llm_worker.vllm_ext.sampling.audio_mask import AudioSlotMask
from llm_worker.vllm_ext.sampling.constraint import counter_index, end_of_speech_stops
from llm_worker.vllm_ext.sampling.counters import SINK, DeviceTally
from llm_worker.vllm_ext.token_space import engine_token_space
from shm.records import FRAME_CODES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.sampling_params import SamplingParams


class AudioTokenConstraintV2(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, req_states: LogitsProcRequestState):
        n = req_states.max_num_reqs
        device = req_states.device
        spec = vllm_config.speculative_config
        drafts = (spec.num_speculative_tokens or 0) if spec is not None else 0
        rows = n * (1 + drafts)
        self.req_states = req_states
        self.constrained_np = np.zeros(n, dtype=bool)
        self.constrained = torch.zeros(n, dtype=torch.bool, device=device)
        self.eos_stops = torch.zeros(n, dtype=torch.bool, device=device)
        self.counter = torch.zeros(n, dtype=torch.int64, device=device)
        self.space = engine_token_space(vllm_config)
        self.mask = AudioSlotMask(rows, device, self.space)
        self.tally = DeviceTally(torch.device(device))

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        RequestArgs.of(sampling_params)

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        args = RequestArgs.of(sampling_params)
        on = args is not None and args.constrain_audio
        self.constrained_np[req_idx] = on
        # Python scalars written into device tensors become fill kernels: no copy, no sync.
        self.constrained[req_idx] = on
        self.eos_stops[req_idx] = on and end_of_speech_stops(sampling_params, self.space)
        self.counter[req_idx] = counter_index(args, self.tally) if on and args else SINK
        return on

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        flags = self.constrained_np[ctx.idx_mapping_np]
        if not flags.any():
            return logits
        req = ctx.expanded_idx_mapping.long()
        sampled_pos = ctx.pos.long() + 1
        # Read the UVA-backed views every step: the runner replaces them on refills.
        prompt_len = self.req_states.prompt_len.gpu[req]
        slot = (sampled_pos - prompt_len).remainder_(FRAME_CODES)
        invalid = self.mask.apply_(
            logits,
            slot,
            self.eos_stops[req],
            None if flags.all() else self.constrained[req],
            self.tally.attached,
        )
        if invalid is not None:
            kept = sampled_pos >= self.req_states.prefill_len.gpu[req]
            self.tally.add(self.counter[req], invalid & kept)
            self.tally.publish()
        return logits
