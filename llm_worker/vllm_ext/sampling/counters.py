"""How many invalid audio tokens the constraint prevented, per stream and in total.

The audio-token constraint runs inside vLLM's EngineCore, a different process from the
llm_worker's event loop, so its counts travel through a small POSIX shared-memory
segment, the *board*: a header and ``1 + slots`` cumulative int64 counters.

- Counter 0 is the sink: counts of constrained requests that carry no per-stream slot.
- Counters ``1..slots`` are per-stream slots. The llm_worker takes one with
  :meth:`CounterSlots.acquire` when it submits a request, passes it in the request's
  ``extra_args`` (see :mod:`llm_worker.vllm_ext.sampling.plan`), and reads the stream's count
  (the counter's value now minus its value at acquire time) when the stream ends.
- Counters are cumulative and never reset, so a late write by an aborted request is
  never lost and readers need no lock. Slots are reused first-in first-out, so a slot
  is handed out again only after every other free slot has been.

The engine side (:class:`DeviceTally`) adds each step's flags with one ``index_add_``.
Under tensor parallelism every rank samples the same tokens; only the first rank writes.
On the CPU build the tally *is* the board (zero copies, exact at the moment the step's
tokens leave the sampler). On CUDA the tally lives on the device and is mirrored to the
board through a pinned buffer without blocking the host, so the board lags the device by
up to two engine steps.
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
import torch

from shm.ring import segment_path

_MAGIC = 0x4F52_5048_4356_5431  # "ORPHCVT1"
_HEADER = struct.Struct("<QQ")  # magic, number of per-stream slots
_HEADER_BYTES = 64
SINK = 0
"""Counter of constrained requests that have no per-stream slot."""


class PreventedBoard:
    """The shared-memory counters. Create in the llm_worker, attach in the engine."""

    def __init__(self, name: str, mm: mmap.mmap, slots: int, owner: bool) -> None:
        self.name = name
        self.slots = slots
        self._mm = mm
        self._owner = owner
        self.counts: np.ndarray = np.frombuffer(
            mm, dtype=np.int64, count=1 + slots, offset=_HEADER_BYTES
        )
        """``counts[0]`` is the sink, ``counts[s]`` the per-stream slot ``s``."""

    @classmethod
    def create(cls, name: str, slots: int) -> PreventedBoard:
        """Create the segment ``/dev/shm/<name>`` (it must not exist)."""
        if slots < 1:
            raise ValueError("a board needs at least one slot")
        size = _HEADER_BYTES + 8 * (1 + slots)
        fd = os.open(segment_path(name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        _HEADER.pack_into(mm, 0, _MAGIC, slots)
        return cls(name, mm, slots, owner=True)

    @classmethod
    def attach(cls, name: str) -> PreventedBoard:
        fd = os.open(segment_path(name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, slots = _HEADER.unpack_from(mm, 0)
        if magic != _MAGIC or size < _HEADER_BYTES + 8 * (1 + slots):
            mm.close()
            raise ValueError(f"/dev/shm/{name} is not a prevented-token board")
        return cls(name, mm, slots, owner=False)

    def read(self, slot: int) -> int:
        return int(self.counts[slot])

    def total(self) -> int:
        """Every prevented token counted so far, attributed or not (for a Prometheus counter)."""
        return int(self.counts.sum())

    def close(self) -> None:
        """Unmap; the creator also unlinks the segment. Idempotent."""
        if self._mm.closed:
            return
        del self.counts  # the exported buffer must go before the map can close
        self._mm.close()
        if self._owner:
            try:
                os.unlink(segment_path(self.name))
            except FileNotFoundError:
                pass


@dataclass(frozen=True, slots=True)
class Counter:
    """One stream's claim on a board slot."""

    slot: int
    baseline: int


class CounterSlots:
    """First-in first-out allocator of a board's per-stream slots (llm_worker side)."""

    def __init__(self, board: PreventedBoard) -> None:
        self.board = board
        self._free: collections.deque[int] = collections.deque(range(1, board.slots + 1))

    def acquire(self) -> Counter | None:
        """A slot for a new stream, or None when all are taken (its counts go to the sink)."""
        if not self._free:
            return None
        slot = self._free.popleft()
        return Counter(slot, self.board.read(slot))

    def count(self, counter: Counter) -> int:
        return self.board.read(counter.slot) - counter.baseline

    def release(self, counter: Counter) -> int:
        """Return the stream's final count and give the slot back."""
        n = self.count(counter)
        self._free.append(counter.slot)
        return n


class DeviceTally:
    """Engine-side accumulation into a board, attached lazily by name.

    Until a request names a board the tally is detached and :attr:`attached` is False;
    processors then skip the work that only counting needs.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.board: PreventedBoard | None = None
        self._cum: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self._copy_pending = False

    @property
    def attached(self) -> bool:
        return self.board is not None

    @property
    def slots(self) -> int:
        return self.board.slots if self.board is not None else 0

    def attach(self, name: str) -> bool:
        """Attach to the named board; False if a different board is already attached.

        On any tensor-parallel rank but the first this does nothing and returns True: the
        first rank counts the same tokens.
        """
        if self.board is not None:
            return self.board.name == name
        if not _first_tp_rank():
            return True
        board = PreventedBoard.attach(name)
        self.board = board
        host = torch.from_numpy(board.counts)
        if self.device.type == "cpu":
            self._cum = host  # the board itself: index_add_ writes shared memory directly
        else:
            self._cum = host.to(self.device)
            self._staging = torch.empty_like(host, pin_memory=True)
            self._copied = torch.cuda.Event()
        return True

    def add(self, index: torch.Tensor, flags: torch.Tensor, sign: int = 1) -> None:
        """``counts[index[i]] += sign * flags[i]`` (flags bool or int, on the tally's device)."""
        assert self._cum is not None
        self._cum.index_add_(0, index, flags.to(torch.int64), alpha=sign)

    def publish(self) -> None:
        """Mirror the device counts to the board (CUDA only; the CPU tally is the board).

        Never blocks: the previous step's copy is folded in only once its event has
        completed, and the new copy is issued asynchronously into the pinned buffer.
        """
        if self._staging is None or self.board is None:
            return
        assert self._cum is not None and self._copied is not None
        if self._copy_pending:
            if not self._copied.query():
                return  # still in flight: fold it in at a later step
            self.board.counts[:] = self._staging.numpy()
        self._staging.copy_(self._cum, non_blocking=True)
        self._copied.record()
        self._copy_pending = True

    def close(self) -> None:
        if self.board is not None:
            self._cum = None
            self.board.close()
            self.board = None


def _first_tp_rank() -> bool:
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0
