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
soak's gateway made ~0.5 young collections a second: one full collection in 5.5 hours). aiohttp leaves every WebSocket
connection in a cycle (its ``RequestHandler`` keeps the response's ``_on_data_received``
after ``connection_lost``), so a soak's gateway held hours of closed connections: +2 MB/h
(docs/performance.md, "Memory over hours"). ``settle`` therefore also starts a daemon
thread that runs a full collection every ``FULL_COLLECTION_EVERY_S``: the garbage that
waits is bounded by what one period makes, and the pause, over what was made since
start-up only (the rest is frozen), comes once per period.
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
FULL_COLLECTION_EVERY_S = 60.0
"""Seconds between two full collections of a settled process (``None`` or 0: only
CPython's own, after ``OLDER_GENERATION_EVERY ** 2`` young ones)."""


class Sweeps(msgspec.Struct):
    """The full collections on the clock so far (read with :func:`sweeps`)."""

    count: int = 0
    collected: int = 0
    """Unreachable objects they found."""
    last_s: float = 0.0
    max_s: float = 0.0
    """Longest pause (wall time of ``gc.collect``; every thread stands still for it)."""


_sweeps = Sweeps()
_sweeper: threading.Thread | None = None


def sweeps() -> Sweeps:
    """A copy of what the full collections on the clock have done in this process."""
    return msgspec.structs.replace(_sweeps)


def _sweep_forever(every_s: float) -> None:
    while True:
        time.sleep(every_s)
        t = time.perf_counter()
        found = gc.collect()
        pause = time.perf_counter() - t
        _sweeps.count += 1
        _sweeps.collected += found
        _sweeps.last_s = pause
        _sweeps.max_s = max(_sweeps.max_s, pause)
        log.debug("full collection: %d unreachable, %.1f ms", found, pause * 1000)


def settle(full_every_s: float | None = FULL_COLLECTION_EVERY_S) -> int:
    """Collect once, freeze the survivors, collect the older generations rarely, and all of
    them every ``full_every_s`` seconds (one thread per process, started once).

    Returns the number of objects frozen.
    """
    global _sweeper
    gc.collect()
    gc.freeze()
    gen0 = gc.get_threshold()[0]
    gc.set_threshold(gen0, OLDER_GENERATION_EVERY, OLDER_GENERATION_EVERY)
    if full_every_s and _sweeper is None:
        _sweeper = threading.Thread(
            target=_sweep_forever, args=(full_every_s,), name="orpheus-gc-sweep", daemon=True
        )
        _sweeper.start()
    return gc.get_freeze_count()
