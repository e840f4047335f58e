"""The audio-token constraint as a handful of batched tensor ops (no per-row Python).

Orpheus emits frames of 7 tokens; the token at audio position p (0 = the first token
after start-of-speech) must lie in slot ``s = p mod 7``'s range
``[AUDIO_TOKEN_BASE + s*4096, +4096)``, or be end-of-speech at a frame boundary
(``s == 0``) when end-of-speech ends the request. For each constrained row:

1. gather the allowed 4096-wide window and the end-of-speech logit;
2. optionally count: the row's unconstrained argmax was invalid if some disallowed
   token scores strictly higher than every allowed one (a full-row ``amax``);
3. set the whole row to -inf, then scatter the window back and restore end-of-speech
   where it is allowed.

Step 3 writes each logit once (a fill) instead of building a ``[batch, vocab]`` mask.
Values already at -inf stay there (min_tokens masks end-of-speech before this runs).

Column numbers are engine ids (:class:`llm_worker.engine.output_head.TokenSpace`): with the audio
output head the audio block starts at column 10 and end-of-speech is column 2.
"""

from __future__ import annotations

import torch

from llm_worker.vllm_ext.token_space import TokenSpace
from shm.records import CODEBOOK_SIZE

NEG_INF = float("-inf")


class AudioSlotMask:
    """Scratch buffers for up to ``max_rows`` logits rows, allocated once."""

    def __init__(self, max_rows: int, device: torch.device, space: TokenSpace) -> None:
        self._audio_base = space.audio_token_base
        self._eos = space.end_of_speech
        self._offsets = torch.arange(CODEBOOK_SIZE, dtype=torch.int64, device=device)
        self._index = torch.empty((max_rows, CODEBOOK_SIZE), dtype=torch.int64, device=device)
        self._window = torch.empty((max_rows, CODEBOOK_SIZE), dtype=torch.float32, device=device)
        self._start = torch.empty(max_rows, dtype=torch.int64, device=device)

    def apply_(
        self,
        logits: torch.Tensor,
        slot: torch.Tensor,
        eos_stops: torch.Tensor,
        constrained: torch.Tensor | None,
        count: bool,
    ) -> torch.Tensor | None:
        """Constrain ``logits`` in place.

        Args:
            logits: ``[rows, vocab]`` float32.
            slot: ``[rows]`` int64, each row's slot (audio position mod 7).
            eos_stops: ``[rows]`` bool, end-of-speech ends the row's request (then it is
                allowed at slot 0).
            constrained: ``[rows]`` bool, rows to constrain; None means every row.
            count: compute the rows whose unconstrained argmax was invalid.

        Returns:
            ``[rows]`` bool (invalid argmax, False for unconstrained rows) if ``count``.
        """
        rows = logits.shape[0]
        start = torch.mul(slot, CODEBOOK_SIZE, out=self._start[:rows])
        start.add_(self._audio_base)
        index = torch.add(start.unsqueeze(1), self._offsets, out=self._index[:rows])
        window = torch.gather(logits, 1, index, out=self._window[:rows])
        eos = logits[:, self._eos].clone()
        eos_allowed = torch.where(eos_stops & (slot == 0), eos, NEG_INF)

        invalid = None
        if count:
            best_allowed = torch.maximum(window.amax(dim=1), eos_allowed)
            invalid = logits.amax(dim=1) > best_allowed
            if constrained is not None:
                invalid &= constrained

        if constrained is None:
            logits.fill_(NEG_INF)
            logits[:, self._eos] = eos_allowed
        else:
            logits.masked_fill_(constrained.unsqueeze(1), NEG_INF)
            logits[:, self._eos] = torch.where(constrained, eos_allowed, eos)
        # Unconstrained rows get their own window back: a no-op for them.
        logits.scatter_(1, index, window)
        return invalid
