"""Host memory for CPU decoding: keep the C allocator's freed blocks in the process.

glibc's malloc serves every block above its mmap threshold (at most 32 MB by default) with a
fresh ``mmap`` and unmaps it on free. A decoder activation of a large CPU batch is 100+ MB,
so every operation of every batch page-faults its output into existence again; measured on
SNAC (32 windows of 12 frames), that made a batch cost 1.5x the CPU time of the same windows
in batches of two. Serving large blocks from the heap and not trimming it removes the
penalty; the process keeps its peak decode footprint (a few hundred MB) resident.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = (1 << 31) - 1


def retain_freed_memory(mmap_threshold: int = 1 << 30) -> bool:
    """Configure glibc malloc for large reused blocks. False where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _INT_MAX)
    )
    if not ok:
        log.warning("mallopt refused: CPU decoding keeps glibc's default allocation thresholds")
    return ok
