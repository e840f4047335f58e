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
nothing trimmed each new largest batch would raise the worker's RSS for good
(docs/performance.md, "Memory over hours"). ``HeapBound.after_batch`` (:mod:`common.host_heap`) runs between batches: at most every
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

from common.host_heap import KEEP_FREE_BYTES, TRIM_EVERY_S, HeapBound, glibc

__all__ = ["KEEP_FREE_BYTES", "TRIM_EVERY_S", "HeapBound", "retain_freed_memory"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1


def retain_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Configure glibc malloc for large reused blocks (trimming is left to ``HeapBound``).
    False where libc is not glibc."""
    libc = glibc()
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
