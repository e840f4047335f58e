"""Make a random-weight model emit what a trained Orpheus emits: audio tokens in slot order.

A trained checkpoint puts the token of position ``p`` in slot ``p mod 7``'s range and may
end only at a frame boundary. Random weights sample the whole 156,940-token vocabulary,
so without this both servers would mostly emit text tokens and a benchmark would
measure noise. This vLLM (V1) logits processor masks every other token. It is the same
restriction orpheus-serve applies (``llm.constrain_audio_tokens``), so it is not a
difference between the two systems under comparison: it stands in for trained weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from llm_worker.vllm_ext import tokens as T
from shm.records import CODEBOOK_SIZE, FRAME_CODES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

UNCONSTRAINED = FRAME_CODES
"""Row of the mask table that blocks nothing (requests without an output list)."""


def blocked_table(vocab_size: int) -> torch.Tensor:
    """``(8, vocab)`` bool: row ``s < 7`` blocks all but slot ``s``'s audio range (and, in
    slot 0, the end-of-speech token); row 7 blocks nothing."""
    blocked = torch.ones(FRAME_CODES + 1, vocab_size, dtype=torch.bool)
    for slot in range(FRAME_CODES):
        lo = T.AUDIO_TOKEN_BASE + slot * CODEBOOK_SIZE
        blocked[slot, lo : lo + CODEBOOK_SIZE] = False
    blocked[0, T.END_OF_SPEECH] = False
    blocked[UNCONSTRAINED] = False
    return blocked


class AudioSlotConstraint(LogitsProcessor):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        self._blocked = blocked_table(vllm_config.model_config.get_vocab_size()).to(device)
        self._outputs: dict[int, Sequence[int]] = {}
        """Persistent-batch index -> the request's live list of output token ids."""
        self._device = device

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for index in batch_update.removed:
            self._outputs.pop(index, None)
        for index, _params, _prompt, output_ids in batch_update.added:
            self._outputs[index] = output_ids
        for a, b, direction in batch_update.moved:
            out_a = self._outputs.pop(a, None)
            out_b = self._outputs.pop(b, None)
            if out_a is not None:
                self._outputs[b] = out_a
            if direction is MoveDirectionality.SWAP and out_b is not None:
                self._outputs[a] = out_b

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        rows = [
            len(self._outputs[i]) % FRAME_CODES if i in self._outputs else UNCONSTRAINED
            for i in range(logits.shape[0])
        ]
        if logits.shape[1] != self._blocked.shape[1]:  # padded vocabulary
            self._blocked = blocked_table(logits.shape[1]).to(self._device)
        slots = torch.tensor(rows, dtype=torch.long, device=self._device)
        return logits.masked_fill_(self._blocked[slots], float("-inf"))
