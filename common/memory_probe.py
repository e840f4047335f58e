"""A measurement tool: where a process's memory goes, sampled from inside it.

Started only when ``ORPHEUS_PROFILE_MEMORY`` names a directory (unset, nothing of it is
imported): by :mod:`orchestrator.child` in every worker the server starts (gateways, llm
workers, the codec worker), by the project's vLLM plugin (:mod:`llm_worker.vllm_ext.plugin`)
in every process vLLM starts (its engine core and workers), and in the gateway process of
``bench gateway`` (:mod:`bench.gateway.synthetic`). A daemon thread appends one
JSON line every ``ORPHEUS_PROFILE_MEMORY_EVERY_S`` seconds (default 10) to
``DIR/<pid>.jsonl``:

- ``name``: the process title (``orpheus-serve gateway-0``, ``VLLM::Worker``, ...);
- ``rollup``: ``/proc/self/smaps_rollup`` in bytes (Rss, Anonymous, Private_Dirty, ...);
- ``heap_rss``: the resident bytes of the ``[heap]`` mapping (glibc's main arena);
- ``malloc``: glibc's ``mallinfo2`` (``arena``: bytes the arenas hold from the kernel,
  ``uordblks``: of those in use, ``fordblks``: free, ``hblkhd``: bytes in mmapped blocks):
  in-use growing is live memory, free growing with in-use flat is fragmentation;
- ``objects``: the counts of the ``ORPHEUS_PROFILE_MEMORY_TYPES`` most numerous types among
  the collector's objects (default 25; 0 skips the walk, which holds the GIL for a moment);
  objects frozen at start-up (:func:`common.heap.settle`) are not among them;
- ``gc``: the collector's state: ``counts`` (allocations since the last collection of each
  generation), ``collections`` and ``collected`` per generation, ``frozen``, and ``sweeps``
  (the full collections on the clock of :func:`common.heap.settle`: count, found, pauses).

``scripts/dev/worker_memory.py`` drives an engine and reads these files; ``bench soak
--profile-memory DIR`` sets the variable for the server it starts.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from common import heap
from common.host_heap import mallinfo2

ENV = "ORPHEUS_PROFILE_MEMORY"
EVERY_ENV = "ORPHEUS_PROFILE_MEMORY_EVERY_S"
TYPES_ENV = "ORPHEUS_PROFILE_MEMORY_TYPES"


def _title() -> str:
    try:
        raw = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return "?"
    # the title vLLM set (VLLM::EngineCore, VLLM::Worker) or the interpreter's file name: no
    # machine path goes into the samples, which are committed under docs/results/
    return os.path.basename(raw.split(b"\0", 1)[0].decode(errors="replace"))


def rollup() -> dict[str, int]:
    """``/proc/self/smaps_rollup`` fields in bytes."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def heap_rss() -> int:
    """Resident bytes of the ``[heap]`` mapping (0 if none)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[0].islower() and not line[0].isupper():
                inside = line.rstrip().endswith("[heap]")
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    return 0


def collector() -> dict[str, Any]:
    """The cyclic collector's state: what waits in each generation and what it has done."""
    stats = gc.get_stats()
    return {
        "counts": list(gc.get_count()),
        "collections": [s["collections"] for s in stats],
        "collected": [s["collected"] for s in stats],
        "frozen": gc.get_freeze_count(),
        "sweeps": msgspec.to_builtins(heap.sweeps()),
    }


def sample(mallinfo: Any, types: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"t": time.time(), "name": _title(), "rollup": rollup()}
    rec["heap_rss"] = heap_rss()
    if mallinfo is not None:
        info = mallinfo()
        rec["malloc"] = {name: int(getattr(info, name)) for name, _ in info._fields_}
    if types > 0:
        counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        rec["objects"] = dict(counts.most_common(types))
        rec["objects_total"] = sum(counts.values())
    rec["gc"] = collector()
    return rec


def _run(path: Path, every_s: float, types: int) -> None:
    mallinfo = mallinfo2()
    while True:
        try:
            line = json.dumps(sample(mallinfo, types))
        except Exception as e:  # a probe must not take its process down
            line = json.dumps({"t": time.time(), "error": f"{type(e).__name__}: {e}"})
        try:
            with path.open("a") as f:
                f.write(line + "\n")
        except OSError:
            return  # its directory went away (a test's, removed): nothing left to write to
        time.sleep(every_s)


_started_in: int | None = None
"""The pid whose sampling thread is running (a forked child starts its own)."""


def install_from_environment() -> bool:
    """Start the sampling thread when ``ORPHEUS_PROFILE_MEMORY`` names a directory (once per
    process: the llm worker is both the server's worker and a process vLLM loads its plugin
    into)."""
    global _started_in
    directory = os.environ.get(ENV, "").strip()
    if not directory:
        return False
    if _started_in == os.getpid():
        return True
    _started_in = os.getpid()
    every_s = float(os.environ.get(EVERY_ENV, "10"))
    types = int(os.environ.get(TYPES_ENV, "25"))
    Path(directory).mkdir(parents=True, exist_ok=True)
    path = Path(directory) / f"{os.getpid()}.jsonl"
    threading.Thread(
        target=_run, args=(path, every_s, types), name="orpheus-memory-probe", daemon=True
    ).start()
    return True
