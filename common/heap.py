"""Garbage-collector settings for the serving processes.

CPython's cyclic collector walks every tracked container of the generations it collects,
while the serving loops stand still. A serving process holds hundreds of thousands of
long-lived objects (imported modules, the app, the engine) that never become garbage, and
its hot paths make almost no reference cycles: on the gateway at 1000 streams the older
generations' collections found nothing to free, yet a full one paused the event loop for up
to 96 ms, which at 70 % load turned into the p99 delivery lag (docs/performance.md).

``settle`` is called once, when start-up is over: everything alive then is frozen out of
the collector's reach (``gc.freeze``), and generations 1 and 2 are collected ten times less
often. Young objects are still collected as before; cycles are still found, later.
"""

from __future__ import annotations

import gc

OLDER_GENERATION_EVERY = 100
"""Collections of the next younger generation per collection of generations 1 and 2
(CPython's default is 10)."""


def settle() -> int:
    """Collect once, freeze the survivors, collect the older generations rarely.

    Returns the number of objects frozen.
    """
    gc.collect()
    gc.freeze()
    gen0 = gc.get_threshold()[0]
    gc.set_threshold(gen0, OLDER_GENERATION_EVERY, OLDER_GENERATION_EVERY)
    return gc.get_freeze_count()
