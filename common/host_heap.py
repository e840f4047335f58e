"""glibc's heap, seen and trimmed from Python: ``mallinfo2`` and ``malloc_trim`` by ctypes.

A process that allocates blocks of many sizes (a batch's activations) leaves free memory in
malloc's arenas when the batch ends; glibc hands back only the top of the heap, and only
when that top is larger than its trim threshold, so a flood's high-water stays resident
(docs/performance.md, "Memory over hours"). ``HeapBound`` hands the free pages back,
anywhere in the heap, at most once an interval and only when more than a bound is free.
Used by the codec worker between batches (``codec_worker.host_memory``) and by a thread in
vLLM's CPU processes (``llm_worker.vllm_ext.heap_trim``).
"""

from __future__ import annotations

import ctypes
from typing import Any

KEEP_FREE_BYTES = 64 << 20
"""Free heap memory below which nothing is trimmed (docs/configuration.md)."""
TRIM_EVERY_S = 15.0
"""The most often the free heap memory is handed back (docs/configuration.md)."""


def glibc() -> ctypes.CDLL | None:
    """The C library, where it is glibc (None elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018  (glibc has it; musl's libc.so.6 does not exist)
    except (OSError, AttributeError):
        return None
    return libc


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (2.33+): ``arena`` bytes the arenas hold from the kernel,
    of which ``uordblks`` in use and ``fordblks`` free; ``hblkhd`` bytes in mmapped blocks."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


def mallinfo2() -> Any:
    """glibc's ``mallinfo2`` function (returns a :class:`MallInfo2`), or None where absent."""
    fn = getattr(glibc(), "mallinfo2", None)
    if fn is not None:
        fn.restype = MallInfo2
    return fn


class HeapBound:
    """Hands the heap's free pages back, at most every ``every_s`` and only when more than
    ``keep_bytes`` is free (glibc 2.33+; elsewhere nothing is trimmed)."""

    def __init__(self, keep_bytes: int = KEEP_FREE_BYTES, every_s: float = TRIM_EVERY_S) -> None:
        self.keep_bytes = keep_bytes
        self.every_s = every_s
        self.trims = 0
        self._next = 0.0
        self._batched = False
        """A batch ran since the last trim (an idle worker trims once, then not again)."""
        self._mallinfo2 = mallinfo2()
        trim = getattr(glibc(), "malloc_trim", None)
        if self._mallinfo2 is not None and trim is not None:
            trim.argtypes = [ctypes.c_size_t]
            self._trim = trim
        else:
            self._mallinfo2 = self._trim = None

    @property
    def active(self) -> bool:
        return self._trim is not None

    def free_bytes(self) -> int:
        """Free bytes in malloc's arenas, resident or not (0 where unknown)."""
        return int(self._mallinfo2().fordblks) if self._mallinfo2 is not None else 0

    def after_batch(self, now: float) -> bool:
        """Trim if the interval has passed and more than ``keep_bytes`` is free. True if it
        trimmed."""
        self._batched = True
        if self._trim is None or now < self._next:
            return False
        self._next = now + self.every_s
        return self.trim_if_free()

    def when_idle(self) -> bool:
        """The worker has nothing to decode: trim now (once per idle spell) if more than
        ``keep_bytes`` is free, so an idle worker holds no flood's memory. True if it
        trimmed."""
        if self._trim is None or not self._batched:
            return False
        return self.trim_if_free()

    def trim_if_free(self) -> bool:
        """Trim now if more than ``keep_bytes`` is free. True if it trimmed."""
        self._batched = False
        if self._trim is None or self.free_bytes() <= self.keep_bytes:
            return False
        self._trim(0)
        self.trims += 1
        return True
