"""A level from its step signals (pure): the intervals between steps, the first wave's
staggered lengths, the streams' split over the engines, one engine's share of a level and
the engines' shares combined."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from bench.engine.results import PHASE_ORDER, EngineLevel, Level
from bench.lib.stats import percentile


def intervals_ms(stamps: Sequence[float]) -> list[float]:
    """Milliseconds between consecutive step signals (``stamps`` in seconds)."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


def first_wave_lengths(streams: int, tokens: int) -> list[int]:
    """Token counts of the first wave's requests: ``tokens * (i + 1) / streams``, at least 1,
    so that they end one after another over one generation's length."""
    return [max(1, math.ceil(tokens * (i + 1) / streams)) for i in range(streams)]


def shares(streams: int, engines: int) -> list[int]:
    """How ``streams`` split over ``engines``: as evenly as possible, the first ones get the
    remainder."""
    if engines < 1 or streams < engines:
        raise ValueError(f"{streams} streams cannot give each of {engines} engines one")
    q, r = divmod(streams, engines)
    return [q + (1 if i < r else 0) for i in range(engines)]


def summarize_engine(
    engine: int,
    streams: int,
    stamps: Sequence[float],
    tokens: int,
    wall_s: float,
    engine_cpu_s: float | None,
    frontend_cpu_s: float,
    phases: tuple[dict[str, float], dict[str, float]] | None = None,
) -> EngineLevel:
    """One engine's share of a level: its step signals' times in the window, the tokens it
    delivered in the window (``wall_s`` long) and the CPU seconds its processes used."""
    steps = intervals_ms(stamps)
    if not steps:
        raise ValueError("a level needs at least two step signals")
    return EngineLevel(
        engine=engine,
        streams=streams,
        steps=len(steps),
        step_ms_p50=round(percentile(steps, 50), 3),
        step_ms_p99=round(percentile(steps, 99), 3),
        engine_cpu_ms_per_step=(
            None if engine_cpu_s is None else round(engine_cpu_s * 1e3 / len(steps), 3)
        ),
        tokens=tokens,
        tokens_per_s=round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        frontend_cpu_ms_per_step=round(frontend_cpu_s * 1e3 / len(steps), 3),
        phases_us_per_request_step=(phases[0] or None) if phases else None,
        requests_per_step=(phases[1] or None) if phases else None,
    )


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def combine(
    variant: str, engines: Sequence[EngineLevel], gpu_busy: float | None, mps: bool | None
) -> Level:
    """A level from its engines' shares: the slowest engine's step times, the mean engine
    core CPU per step, the summed tokens/s, the mean µs per request-step of each phase that
    every engine reported."""
    if not engines:
        raise ValueError("a level needs at least one engine")
    cpu = [e.engine_cpu_ms_per_step for e in engines]
    phases: dict[str, float] | None = None
    tables = [e.phases_us_per_request_step for e in engines]
    if all(tables):
        common = set.intersection(*(set(t) for t in tables if t))
        phases = {
            p: round(mean([t[p] for t in tables if t]), 3) for p in sorted(common, key=phase_key)
        }
    return Level(
        variant=variant,
        streams=sum(e.streams for e in engines),
        step_ms_p50=max(e.step_ms_p50 for e in engines),
        step_ms_p99=max(e.step_ms_p99 for e in engines),
        engine_cpu_ms_per_step=(
            None if any(c is None for c in cpu) else round(mean([c or 0.0 for c in cpu]), 3)
        ),
        gpu_busy_fraction=None if gpu_busy is None else round(gpu_busy, 3),
        tokens_per_s=round(sum(e.tokens_per_s for e in engines), 1),
        engines=len(engines),
        mps=mps,
        per_engine=list(engines),
        phases_us_per_request_step=phases,
    )


def phase_key(name: str) -> tuple[int, str]:
    return (PHASE_ORDER.index(name) if name in PHASE_ORDER else len(PHASE_ORDER), name)
