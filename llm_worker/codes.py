"""Audio tokens to SNAC code frames, vectorised over all streams of one engine step.

docs/orpheus.md: the token at audio position ``p`` (counted from the first audio token of a
generation) carries ``code = id - 128266 - (p mod 7) * 4096``, valid in ``[0, 4096)``;
code 0 is valid. Seven positions make one frame.

Rules this module enforces:

- Positions never shift: every generated token advances its stream's position by one,
  valid or not. (The reference decoder's ``token > 0`` filter shifted them, garbling every
  later frame.)
- An invalid token drops the whole frame it belongs to, and only that frame; it is counted.
- Frames may span engine steps: a stream's incomplete frame waits in a per-row table.

Each stream holds a *row* of that table (like vLLM's persistent batch), so one call maps
every stream's new tokens with a handful of numpy operations and no per-token Python.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from llm_worker.vllm_ext import tokens as T
from shm.records import CODE_DTYPE, CODEBOOK_SIZE, FRAME_CODES


class StepFrames(NamedTuple):
    """The result of one :meth:`FrameAssembler.map` call, per input entry (in input order)."""

    frames: np.ndarray
    """``(sum(counts), 7)`` int16: the complete valid frames, entry by entry. A view into
    the assembler's scratch: valid until its next ``map``."""
    counts: np.ndarray
    """Complete valid frames per entry (their rows in ``frames`` are consecutive)."""
    dropped: np.ndarray
    """Complete frames dropped per entry because they held an invalid token."""
    invalid_tokens: np.ndarray
    """Tokens per entry outside their slot's range."""

    def offsets(self) -> np.ndarray:
        """``offsets[i]:offsets[i+1]`` are entry i's rows of ``frames``."""
        out = np.zeros(len(self.counts) + 1, dtype=np.int64)
        np.cumsum(self.counts, out=out[1:])
        return out


class FrameAssembler:
    """Maps audio tokens to frames for many streams at once; one row per stream."""

    def __init__(self, capacity: int = 64) -> None:
        self._partial = np.zeros((0, FRAME_CODES), dtype=CODE_DTYPE)
        self._partial_bad = np.zeros(0, dtype=bool)
        self._pos = np.zeros(0, dtype=np.int64)
        self._free: list[int] = []
        self._grow(capacity)
        # Scratch reused across calls (grown on demand): frames touched, and the output.
        self._touched = np.zeros((0, FRAME_CODES), dtype=CODE_DTYPE)
        self._out = np.zeros((0, FRAME_CODES), dtype=CODE_DTYPE)

    # -- rows ---------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        old = len(self._pos)
        if capacity <= old:
            return
        self._partial = np.concatenate(
            [self._partial, np.zeros((capacity - old, FRAME_CODES), dtype=CODE_DTYPE)]
        )
        self._partial_bad = np.concatenate([self._partial_bad, np.zeros(capacity - old, bool)])
        self._pos = np.concatenate([self._pos, np.zeros(capacity - old, np.int64)])
        self._free.extend(range(capacity - 1, old - 1, -1))

    @property
    def capacity(self) -> int:
        return len(self._pos)

    def open(self) -> int:
        """A row for a new stream, at audio position 0."""
        if not self._free:
            self._grow(2 * self.capacity)
        row = self._free.pop()
        self.reset(row)
        return row

    def reset(self, row: int) -> None:
        """Start a new generation on ``row`` (the next piece of text): position 0."""
        self._pos[row] = 0
        self._partial_bad[row] = False

    def close(self, row: int) -> None:
        self._free.append(row)

    def position(self, row: int) -> int:
        """Audio tokens seen on ``row`` since its last reset."""
        return int(self._pos[row])

    def pending_tokens(self, row: int) -> int:
        """Tokens of the row's incomplete frame (lost if the generation ends here)."""
        return int(self._pos[row] % FRAME_CODES)

    # -- mapping ------------------------------------------------------------------------

    def map(self, rows: np.ndarray, lens: np.ndarray, tokens: np.ndarray) -> StepFrames:
        """Map one step's new tokens.

        ``rows`` (distinct) and ``lens`` give, per entry, the stream's row and how many of
        ``tokens`` (all entries' new token ids, concatenated in entry order) are its own.
        """
        n_entries = len(rows)
        rows = rows.astype(np.int64, copy=False)
        lens = lens.astype(np.int64, copy=False)
        if len(tokens) == n_entries and (n_entries == 0 or int(lens.min()) == 1):
            return self._map_one_each(rows, tokens)
        p0 = self._pos[rows]
        entry_of_tok = np.repeat(np.arange(n_entries), lens)
        tok_start = np.cumsum(lens) - lens
        pos = p0[entry_of_tok] + (np.arange(len(tokens)) - tok_start[entry_of_tok])
        slot = pos % FRAME_CODES
        codes = tokens - T.AUDIO_TOKEN_BASE - slot * CODEBOOK_SIZE
        invalid = (codes < 0) | (codes >= CODEBOOK_SIZE)

        # Frames this step touches: per entry, from the one holding p0 to the one holding
        # the last new token; numbered consecutively across entries.
        has = lens > 0
        first = p0 // FRAME_CODES
        n_frames = np.where(has, (p0 + lens - 1) // FRAME_CODES - first + 1, 0)
        frame_base = np.cumsum(n_frames) - n_frames
        total = int(n_frames.sum())
        frame_of_tok = frame_base[entry_of_tok] + pos // FRAME_CODES - first[entry_of_tok]

        if len(self._touched) < total:
            self._touched = np.zeros((2 * total, FRAME_CODES), dtype=CODE_DTYPE)
            self._out = np.zeros_like(self._touched)
        touched = self._touched[:total]
        # A frame begun in an earlier step resumes from the row's table.
        resumed = has & (p0 % FRAME_CODES != 0)
        touched[frame_base[resumed]] = self._partial[rows[resumed]]
        bad = np.zeros(total, dtype=bool)
        bad[frame_base[resumed]] = self._partial_bad[rows[resumed]]
        # Invalid codes are out of int16 range at worst: wrapping is harmless, they are dropped.
        touched[frame_of_tok, slot] = codes.astype(CODE_DTYPE, copy=False)
        bad[frame_of_tok[invalid]] = True
        complete = np.zeros(total, dtype=bool)
        complete[frame_of_tok[slot == FRAME_CODES - 1]] = True
        keep = complete & ~bad

        # An entry ending mid-frame parks that frame in its row.
        end = p0 + lens
        parked = has & (end % FRAME_CODES != 0)
        last = frame_base + n_frames - 1
        self._partial[rows[parked]] = touched[last[parked]]
        self._partial_bad[rows[parked]] = bad[last[parked]]
        self._pos[rows] = end

        entry_of_frame = np.repeat(np.arange(n_entries), n_frames)
        n_keep = int(keep.sum())
        frames = np.compress(keep, touched, axis=0, out=self._out[:n_keep])
        return StepFrames(
            frames=frames,
            counts=np.bincount(entry_of_frame[keep], minlength=n_entries),
            dropped=np.bincount(entry_of_frame[complete & bad], minlength=n_entries),
            invalid_tokens=np.bincount(entry_of_tok[invalid], minlength=n_entries),
        )

    def _map_one_each(self, rows: np.ndarray, tokens: np.ndarray) -> StepFrames:
        """The steady state of decoding: one new token per stream. The token goes straight
        into its row's frame; a slot-6 token completes it."""
        pos = self._pos[rows]
        slot = pos % FRAME_CODES
        codes = tokens - T.AUDIO_TOKEN_BASE - slot * CODEBOOK_SIZE
        invalid = (codes < 0) | (codes >= CODEBOOK_SIZE)
        self._partial[rows, slot] = codes.astype(CODE_DTYPE, copy=False)
        bad = np.where(slot == 0, invalid, self._partial_bad[rows] | invalid)
        self._partial_bad[rows] = bad
        self._pos[rows] = pos + 1
        complete = slot == FRAME_CODES - 1
        keep = complete & ~bad
        n_keep = int(keep.sum())
        if len(self._out) < n_keep:
            self._touched = np.zeros((2 * n_keep, FRAME_CODES), dtype=CODE_DTYPE)
            self._out = np.zeros_like(self._touched)
        frames = self._out[:n_keep]
        np.take(self._partial, rows[keep], axis=0, out=frames)
        return StepFrames(
            frames=frames,
            counts=keep.astype(np.int64),
            dropped=(complete & bad).astype(np.int64),
            invalid_tokens=invalid.astype(np.int64),
        )


def frames_to_tokens(frames: np.ndarray) -> np.ndarray:
    """The audio token ids that encode ``frames`` ((n, 7) codes): the inverse mapping."""
    offsets = T.AUDIO_TOKEN_BASE + np.arange(FRAME_CODES, dtype=np.int64) * CODEBOOK_SIZE
    return (np.asarray(frames, dtype=np.int64) + offsets).reshape(-1)
