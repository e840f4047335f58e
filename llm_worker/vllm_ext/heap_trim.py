"""Free heap memory handed back in vLLM's CPU processes, from a thread of their own.

vLLM's CPU worker allocates each step's activations with glibc's malloc, in as many sizes as
there are batch shapes. When a flood's prefills end, the memory they used is free but stays
resident: glibc hands back only the top of the heap, and blocks still in use sit above the
freed ones (docs/performance.md, "Memory over hours": the worker's free heap rose 8 -> 68 MB
while its RSS stepped up at floods). vLLM gives no hook between its steps, so a daemon thread
of :class:`common.host_heap.HeapBound` runs ``malloc_trim`` every ``llm.cpu_heap_trim_s``
seconds when more than :data:`KEEP_FREE_BYTES` is free (``malloc_trim`` takes each arena's
lock, so it is safe beside the stepping thread; a step waits at most for one trim, a few
milliseconds).

The llm worker sets :data:`ENV` (``prepare_engine_environment``) before vLLM starts its
processes; the project's vLLM plugin (:mod:`llm_worker.vllm_plugin`) starts the thread in each
of them.
"""

from __future__ import annotations

import logging
import os
import threading

from common.host_heap import HeapBound

log = logging.getLogger(__name__)

ENV = "ORPHEUS_SERVE_VLLM_HEAP_TRIM_S"
"""Seconds between trims in vLLM's processes (unset or 0: none)."""
KEEP_FREE_BYTES = 16 << 20
"""Free heap memory below which nothing is trimmed: less than a step's activations of the
3B model at a full prefill chunk, so steady decoding never re-faults its working set."""

_started: HeapBound | None = None
_stop = threading.Event()


def _run(bound: HeapBound, stop: threading.Event) -> None:
    while not stop.wait(bound.every_s):
        bound.trim_if_free()


def start_from_environment() -> HeapBound | None:
    """Start this process's trimming thread when :data:`ENV` says so (once per process).
    Returns its ``HeapBound`` (None: off, or not glibc)."""
    global _started
    if _started is not None:
        return _started
    raw = os.environ.get(ENV, "").strip()
    every_s = float(raw) if raw else 0.0
    if every_s <= 0:
        return None
    bound = HeapBound(keep_bytes=KEEP_FREE_BYTES, every_s=every_s)
    if not bound.active:
        return None
    _stop.clear()
    threading.Thread(
        target=_run, args=(bound, _stop), name="orpheus-heap-trim", daemon=True
    ).start()
    _started = bound
    return bound


def stop() -> None:
    """End this process's trimming thread (a process that ends needs not call it)."""
    global _started
    _stop.set()
    _started = None
