"""Open-loop arrival schedules, computed before the first request is sent.

The schedule is a list of offsets from the level's start. The runner sends request
``i`` at ``start + offsets[i]`` whatever happened to earlier requests, so a stalled
server cannot slow the arrivals (it can only make the requests wait, and that wait is
counted in their TTFB, which runs from the scheduled time).
"""

from __future__ import annotations

import random


def poisson_schedule(
    rate_per_s: float, horizon_s: float, seed: int, max_count: int | None = None
) -> list[float]:
    """Arrival offsets in ``[0, horizon_s)`` of a Poisson process of the given rate.

    Inter-arrival gaps are exponential with mean ``1 / rate_per_s``; the first arrival is
    one gap after the start. ``max_count`` truncates the list.
    """
    if rate_per_s <= 0:
        raise ValueError("rate must be positive")
    if horizon_s < 0:
        raise ValueError("horizon must not be negative")
    rng = random.Random(seed)
    offsets: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < horizon_s and (max_count is None or len(offsets) < max_count):
        offsets.append(t)
        t += rng.expovariate(rate_per_s)
    return offsets
