"""Orpheus code frames to SNAC's three code levels, vectorised over a batch of windows.

A frame is 7 codes in Orpheus slot order. Level 0 takes slot 0, level 1 slots 1 and 4,
level 2 slots 2, 3, 5 and 6 (docs/orpheus.md), each level in time order.
"""

from __future__ import annotations

import numpy as np
import torch

from shm.records import CODEBOOK_SIZE

SLOT_ORDER = (0, 1, 4, 2, 3, 5, 6)
"""Slots regrouped by level: [level 0 | level 1 (2 codes) | level 2 (4 codes)]."""


def slot_order(device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tensor(SLOT_ORDER, dtype=torch.int64, device=device)


def frames_to_levels(
    frames: torch.Tensor, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B, W, 7)`` frames -> level codes ``(B, W)``, ``(B, 2W)``, ``(B, 4W)`` (int64).

    ``order`` is ``slot_order()`` on the frames' device; hot paths pass a cached one (a
    Python list as an index would be copied to the device on every call).
    """
    b, w, _ = frames.shape
    if order is None:
        order = slot_order(frames.device)
    x = frames.index_select(-1, order).long()
    return x[..., 0], x[..., 1:3].reshape(b, 2 * w), x[..., 3:7].reshape(b, 4 * w)


def levels_to_frames(l0: torch.Tensor, l1: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """Inverse of ``frames_to_levels`` (for tests and tools)."""
    b, w = l0.shape
    grouped = torch.cat([l0[..., None], l1.reshape(b, w, 2), l2.reshape(b, w, 4)], dim=-1)
    frames = torch.empty_like(grouped)
    frames[..., list(SLOT_ORDER)] = grouped
    return frames


def invalid_code_count(frames: np.ndarray) -> int:
    """Codes outside [0, 4096) in an int16 array (one pass: negatives wrap to >= 32768)."""
    return int(np.count_nonzero(frames.view(np.uint16) >= CODEBOOK_SIZE))
