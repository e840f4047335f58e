"""Garbage-collector settings for the serving processes.

CPython's cyclic collector walks every tracked container of the generations it collects,
while the serving loops stand still. A serving process holds hundreds of thousands of
long-lived objects (imported modules, the app, the engine) that never become garbage, and
its hot paths make almost no reference cycles: on the gateway at 1000 streams the older
generations' collections found nothing to free, yet a full one paused the event loop for up
to 96 ms, which at 70 % load turned into the p99 delivery lag (docs/performance.md).

``settle`` is called once, when start-up is over: everything alive then is frozen out of
the collector's reach (``gc.freeze``), and generations 1 and 2 are collected ten times less
often. Young objects are still collected as before.

Cycles are still found, but not *later without bound*: what is alive at a younger
collection and dies afterwards reaches the oldest generation, which CPython collects only
after ``OLDER_GENERATION_EVERY ** 2`` young collections, 100 x later than its defaults (the
soak's gateway made ~0.5 young collections a second: one full collection in 5.5 hours).
aiohttp leaves every WebSocket connection in a cycle (its ``RequestHandler`` keeps the
response's ``_on_data_received`` after ``connection_lost``), so a soak's gateway held hours
of closed connections: +2 MB/h (docs/performance.md, "Memory over hours"). ``settle`` therefore also starts a daemon
thread that runs full collections on a clock: every ``FULL_COLLECTION_MIN_S`` while they
find garbage, the period doubling after each that finds none, up to
``FULL_COLLECTION_MAX_S``. Garbage waits at most one period. The pause walks only what was
made since start-up (the rest is frozen), but that includes every live stream's objects: a
gateway at 1000 streams paused 52-104 ms per full collection, so a process whose traffic
makes no cycles (HTTP streams; the codec and llm workers) is swept 16 x less often.

Start-up itself pays the other way: importing torch and vLLM makes about a million
long-lived objects, and CPython 3.11 walks all of them in each full collection its default
thresholds trigger meanwhile, each longer than the last (0.06 to 0.5 s: about 3 s in each
process that imports vLLM, on a 2-core CPU). So every worker collects its older generations
rarely from its first line (``collect_older_rarely``, ``orchestrator.child``), and so do the
processes vLLM spawns (its engine core), for their whole life: the project's vLLM plugin
freezes what vLLM's import made there (``llm_worker.vllm_ext.plugin.freeze_import_heap``) and
vLLM freezes the rest once the engine is built, as ``settle`` does, so a full collection
there walks only what was made since, and it comes after as many young collections as in the
settled workers.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

import msgspec

log = logging.getLogger(__name__)

OLDER_GENERATION_EVERY = 100
"""Collections of the next younger generation per collection of generations 1 and 2
(CPython's default is 10)."""
FULL_COLLECTION_MIN_S = 60.0
"""Seconds between two full collections of a settled process while they find garbage."""
FULL_COLLECTION_MAX_S = 960.0
"""... and at most this long while they find none (the period doubles after each)."""


class Sweeps(msgspec.Struct):
    """The full collections on the clock so far (read with :func:`sweeps`)."""

    count: int = 0
    collected: int = 0
    """Unreachable objects they found."""
    last_s: float = 0.0
    max_s: float = 0.0
    """Longest pause (wall time of ``gc.collect``; every thread stands still for it)."""
    period_s: float = 0.0
    """The wait before the next one."""


_sweeps = Sweeps()
_sweeper: threading.Thread | None = None


def collect_older_rarely() -> None:
    """The settled thresholds (without the freeze): from the first line of a process about
    to import torch or vLLM (see the module docstring)."""
    gen0 = gc.get_threshold()[0]
    gc.set_threshold(gen0, OLDER_GENERATION_EVERY, OLDER_GENERATION_EVERY)


def sweeps() -> Sweeps:
    """A copy of what the full collections on the clock have done in this process."""
    return msgspec.structs.replace(_sweeps)


def next_period(period_s: float, found: int, min_s: float, max_s: float) -> float:
    """The wait after a full collection that found ``found`` unreachable objects."""
    return min_s if found else min(period_s * 2, max_s)


def _sweep_forever(min_s: float, max_s: float) -> None:
    _sweeps.period_s = min_s
    while True:
        time.sleep(_sweeps.period_s)
        t = time.perf_counter()
        found = gc.collect()
        pause = time.perf_counter() - t
        _sweeps.count += 1
        _sweeps.collected += found
        _sweeps.last_s = pause
        _sweeps.max_s = max(_sweeps.max_s, pause)
        _sweeps.period_s = next_period(_sweeps.period_s, found, min_s, max_s)
        log.debug("full collection: %d unreachable, %.1f ms", found, pause * 1000)


def settle(
    full_min_s: float | None = FULL_COLLECTION_MIN_S, full_max_s: float = FULL_COLLECTION_MAX_S
) -> int:
    """Collect once, freeze the survivors, collect the older generations rarely, and all of
    them on a clock, every ``full_min_s`` to ``full_max_s`` seconds (one thread per process,
    started once; ``full_min_s`` None or 0: none).

    Returns the number of objects frozen.
    """
    global _sweeper
    gc.collect()
    gc.freeze()
    collect_older_rarely()
    if full_min_s and _sweeper is None:
        _sweeper = threading.Thread(
            target=_sweep_forever,
            args=(full_min_s, max(full_min_s, full_max_s)),
            name="orpheus-gc-sweep",
            daemon=True,
        )
        _sweeper.start()
    return gc.get_freeze_count()
