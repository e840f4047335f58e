"""Runaway-loop detection: a generation whose last N frames cycle with a short period.

Orpheus's most common failure is a loop that emits the same few frames for minutes. The
guard hashes every frame (one vectorised projection per step) and keeps, per stream row and
per period ``p`` in ``1..max_period``, how many consecutive frames equalled the frame ``p``
before them. A run of ``N - p`` such frames means the last ``N`` frames are ``p``-periodic.
Cost per step: a few numpy operations over the step's new frames, whatever their number.
"""

from __future__ import annotations

import numpy as np

from shm.records import FRAME_CODES

_HASH_SEED = 0x5EED_0F_A0D10


class RepetitionGuard:
    def __init__(self, window_frames: int, capacity: int = 64) -> None:
        """``window_frames`` is N (0 disables the guard); periods up to N // 4 are caught
        (at least four repetitions of the cycle)."""
        self.window = window_frames
        self.max_period = max(1, window_frames // 4)
        rng = np.random.default_rng(_HASH_SEED)
        self._mult = rng.integers(1, 2**63, size=FRAME_CODES, dtype=np.uint64) | np.uint64(1)
        self._hist = np.zeros((0, self.max_period), dtype=np.uint64)
        self._runs = np.zeros((0, self.max_period), dtype=np.int64)
        self._seen = np.zeros(0, dtype=np.int64)
        self._need = self.window - np.arange(1, self.max_period + 1, dtype=np.int64)
        self._periods = np.arange(1, self.max_period + 1, dtype=np.int64)
        self.ensure_capacity(capacity)

    @property
    def enabled(self) -> bool:
        return self.window > 0

    def ensure_capacity(self, capacity: int) -> None:
        old = len(self._seen)
        if capacity <= old:
            return
        extra = capacity - old
        self._hist = np.concatenate([self._hist, np.zeros((extra, self.max_period), np.uint64)])
        self._runs = np.concatenate([self._runs, np.zeros((extra, self.max_period), np.int64)])
        self._seen = np.concatenate([self._seen, np.zeros(extra, np.int64)])

    def reset(self, row: int) -> None:
        self._runs[row] = 0
        self._seen[row] = 0

    def _hash(self, frames: np.ndarray) -> np.ndarray:
        # uint64 arithmetic wraps: a multiplicative hash of the 7 codes.
        return (frames.astype(np.uint64) * self._mult).sum(axis=1, dtype=np.uint64)

    def observe(self, rows: np.ndarray, frames: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Feed each entry's new frames (``counts[i]`` consecutive rows of ``frames`` for
        ``rows[i]``); returns a bool per entry: its stream is looping."""
        looping = np.zeros(len(rows), dtype=bool)
        if not self.enabled or len(frames) == 0:
            return looping
        hashes = self._hash(frames)
        start = np.cumsum(counts) - counts
        # An entry usually brings 0 or 1 frames per step; several arrive in "waves" so that
        # each wave touches every row at most once and stays vectorised.
        for k in range(int(counts.max())):
            sel = np.flatnonzero(counts > k)
            r = rows[sel]
            h = hashes[start[sel] + k]
            seen = self._seen[r]
            # hist[r, (seen - p) % P] holds the hash p frames back (valid when seen >= p).
            back = (seen[:, None] - self._periods[None, :]) % self.max_period
            prev = self._hist[r[:, None], back]
            same = (prev == h[:, None]) & (seen[:, None] >= self._periods[None, :])
            runs = np.where(same, self._runs[r] + 1, 0)
            self._runs[r] = runs
            self._hist[r, seen % self.max_period] = h
            self._seen[r] = seen + 1
            looping[sel] |= (runs >= self._need[None, :]).any(axis=1)
        return looping
