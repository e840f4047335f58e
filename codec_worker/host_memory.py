"""Host memory for CPU decoding: keep the C allocator's freed blocks for the next batch, up
to a bound.

glibc's malloc serves every block above its mmap threshold (at most 32 MB by default) with a
fresh ``mmap`` and unmaps it on free. A decoder activation of a large CPU batch is 100+ MB,
so every operation of every batch page-faults its output into existence again; measured on
SNAC (32 windows of 12 frames), that made a batch cost 1.5x the CPU time of the same windows
in batches of two. ``retain_freed_memory`` serves large blocks from the heap and turns
glibc's own trimming off (it would trim in the middle of a batch, between two operations).

The heap must not keep everything, though: a flood's batches (up to ``max_batch`` windows
of up to ``max_hop_frames``) need several times the memory of steady traffic, and with
nothing trimmed (the first version) each new largest batch raised the worker's RSS for good:
a 20-minute soak saw it step 452 -> 800 -> 950 -> 1,150 MB at floods (docs/performance.md,
"Memory over hours"). ``HeapBound.after_batch`` runs between batches: at most every
``TRIM_EVERY_S`` and only when more than ``KEEP_FREE_BYTES`` of the heap is free,
``malloc_trim`` hands the free pages back (the top of the heap and whole free pages inside
it). The batches that follow fault their working set in again, once per interval: a few
milliseconds every 15 s for steady traffic. So the worker's RSS is its live memory plus what
the batches of the last interval used: a flood's high-water goes back within ``TRIM_EVERY_S``
of its end, and at once when the worker runs out of streams (``when_idle``, called by the
service between polls).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1

KEEP_FREE_BYTES = 64 << 20
"""Free heap memory below which nothing is trimmed (docs/configuration.md)."""
TRIM_EVERY_S = 15.0
"""The most often the free heap memory is handed back (docs/configuration.md)."""


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt  # noqa: B018  (glibc has it; musl's libc.so.6 does not exist)
    except (OSError, AttributeError):
        return None
    return libc


def retain_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Configure glibc malloc for large reused blocks (trimming is left to ``HeapBound``).
    False where libc is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    )
    if not ok:
        log.warning("mallopt refused: CPU decoding keeps glibc's default allocation thresholds")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
            "fordblks", "keepcost",
        )
    ]  # fmt: skip


class HeapBound:
    """Hands the heap's free pages back between batches, at most every ``every_s`` and only
    when more than ``keep_bytes`` is free (glibc 2.33+; elsewhere ``after_batch`` does
    nothing)."""

    def __init__(self, keep_bytes: int = KEEP_FREE_BYTES, every_s: float = TRIM_EVERY_S) -> None:
        self.keep_bytes = keep_bytes
        self.every_s = every_s
        self.trims = 0
        self._next = 0.0
        self._batched = False
        """A batch ran since the last trim (an idle worker trims once, then not again)."""
        libc = _glibc()
        mallinfo2 = getattr(libc, "mallinfo2", None)
        trim = getattr(libc, "malloc_trim", None)
        if mallinfo2 is not None and trim is not None:
            mallinfo2.restype = _MallInfo2
            trim.argtypes = [ctypes.c_size_t]
            self._mallinfo2, self._trim = mallinfo2, trim
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
        return self._trim_if_free()

    def when_idle(self) -> bool:
        """The worker has nothing to decode: trim now (once per idle spell) if more than
        ``keep_bytes`` is free, so an idle worker holds no flood's memory. True if it
        trimmed."""
        if self._trim is None or not self._batched:
            return False
        return self._trim_if_free()

    def _trim_if_free(self) -> bool:
        self._batched = False
        if self.free_bytes() <= self.keep_bytes:
            return False
        assert self._trim is not None
        self._trim(0)
        self.trims += 1
        return True
