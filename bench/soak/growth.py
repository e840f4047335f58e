"""Growth after warm-up, for ``bench soak``: per process, and of fds and /dev/shm.

A serving process's memory rises while it warms up (imports settle, buffers and allocator
pools reach the sizes the traffic needs, shared-memory rings are first written); after that
it must stay flat. ``check_growth`` takes the soak's samples and, for every process name
(processes of one name are summed), judges its private RSS: RSS less its shared-memory pages
(the rings' pages a process has touched so far grow its RSS until the ring wraps once,
bounded by the ring's size, and are judged with /dev/shm instead).

Both ends of the judged span are levels, not single samples: the *lowest* value in the first
window after the warm-up (a quarter of the span by default) against the lowest in the last
window (the settled sample after the traffic included). Under floods a process's RSS swings
with what its batches hold for a moment (the codec's between 480 MB and 1 GB on CPU, vLLM's
worker over 70 MB) and with the free heap ``common.host_heap.HeapBound`` keeps until its next
trim; one sample of each end compared a mid-flood low with a settled end and failed on that
alone (docs/performance.md, "The soak's verdict"). The lowest value of a window is the level
between floods, the same rule as the memory probe's (``probe_growth``): a leak raises it, a
flood does not. It also fits the least-squares slope of the samples after the warm-up (MB per
hour), and fails a process whose growth exceeds ``max(bound_pct % of its base, floor_mb)``
(``floors_mb`` may give a process its own floor).
Open file descriptors and the instance's /dev/shm segments (their count and apparent size),
judged the same way, must not grow at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import msgspec

MB = 1e6


class ProcLike(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def rss_bytes(self) -> int: ...
    @property
    def shmem_bytes(self) -> int: ...


class SampleLike(Protocol):
    @property
    def t_s(self) -> float: ...
    @property
    def processes(self) -> Sequence[ProcLike]: ...
    @property
    def fds(self) -> int: ...
    @property
    def shm_segments(self) -> int: ...
    @property
    def shm_size_bytes(self) -> int: ...


class ProcessGrowth(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    base_mb: float
    """Lowest private RSS in the first window after the warm-up."""
    end_mb: float
    """Lowest private RSS in the last window."""
    peak_mb: float
    """Highest private RSS after the warm-up."""
    growth_mb: float
    growth_pct: float
    slope_mb_per_h: float
    """Least-squares slope of private RSS over the samples after the warm-up."""
    bound_mb: float
    ok: bool


class GrowthCheck(msgspec.Struct, frozen=True, kw_only=True):
    warmup_s: float
    """Samples from this time on are judged."""
    window_s: float
    """Seconds from the first judged sample to the last one."""
    bound_pct: float
    floor_mb: float
    """The floor of every process not in ``floors_mb``."""
    processes: list[ProcessGrowth]
    fds_growth: int
    shm_segments_growth: int
    shm_size_growth_mb: float
    passed: bool
    problems: list[str]
    """One line per bound broken (empty when passed)."""
    floors_mb: dict[str, float] = {}
    """Floors of the processes named (``--growth-floor NAME=MB``)."""
    level_window_s: float = 0.0
    """Length of the first and the last window whose lowest values are compared (0 in
    reports written before windows were judged: then the first and last samples were)."""


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of ``(t_s, value)`` points, in value units per hour (0 for fewer
    than two distinct times)."""
    n = len(points)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 3600.0


def private_rss_by_name(sample: SampleLike) -> dict[str, int]:
    """Private RSS bytes (RSS less shared memory) per process name (processes of one name
    summed)."""
    out: dict[str, int] = {}
    for p in sample.processes:
        out[p.name] = out.get(p.name, 0) + p.rss_bytes - p.shmem_bytes
    return out


def default_warmup_s(duration_s: float, cap_s: float = 900.0) -> float:
    """The first half of the run, at most ``cap_s`` (15 minutes)."""
    return min(duration_s / 2, cap_s)


def check_growth(
    samples: Sequence[SampleLike],
    warmup_s: float,
    *,
    bound_pct: float = 2.0,
    floor_mb: float = 8.0,
    floors_mb: Mapping[str, float] | None = None,
    level_window_s: float | None = None,
) -> GrowthCheck:
    """Judge the samples (in time order) taken at or after ``warmup_s``: the lowest value of
    each quantity in the first ``level_window_s`` (default: a quarter of the span) against
    the lowest in the last. ``floors_mb``: the floor of the processes it names, instead of
    ``floor_mb``."""
    after = [s for s in samples if s.t_s >= warmup_s]
    if len(after) < 2:
        raise ValueError(
            f"{len(after)} sample(s) at or after the warm-up ({warmup_s:.0f} s): "
            "run longer or sample more often"
        )
    t_first, t_last = after[0].t_s, after[-1].t_s
    w = level_window_s if level_window_s is not None else (t_last - t_first) / 4
    first = [s for s in after if s.t_s <= t_first + w]
    last = [s for s in after if s.t_s >= t_last - w]
    series = [private_rss_by_name(s) for s in after]
    first_rss, last_rss = series[: len(first)], series[len(after) - len(last) :]
    procs: list[ProcessGrowth] = []
    problems: list[str] = []
    for name in sorted(set(series[0]) & set(series[-1])):
        b = min(r[name] for r in first_rss if name in r) / MB
        e = min(r[name] for r in last_rss if name in r) / MB
        points = [
            (s.t_s, rss[name] / MB) for s, rss in zip(after, series, strict=True) if name in rss
        ]
        growth = e - b
        bound = max(b * bound_pct / 100, (floors_mb or {}).get(name, floor_mb))
        ok = growth <= bound
        procs.append(
            ProcessGrowth(
                name=name,
                base_mb=round(b, 1),
                end_mb=round(e, 1),
                peak_mb=round(max(v for _, v in points), 1),
                growth_mb=round(growth, 1),
                growth_pct=round(100 * growth / b, 2) if b else 0.0,
                slope_mb_per_h=round(slope_per_hour(points), 1),
                bound_mb=round(bound, 1),
                ok=ok,
            )
        )
        if not ok:
            problems.append(
                f"{name} grew {growth:+.1f} MB ({100 * growth / b:+.1f}%) after the warm-up; "
                f"bound {bound:.1f} MB"
            )
    fds = min(s.fds for s in last) - min(s.fds for s in first)
    segs = min(s.shm_segments for s in last) - min(s.shm_segments for s in first)
    shm = (min(s.shm_size_bytes for s in last) - min(s.shm_size_bytes for s in first)) / MB
    if fds > 0:
        problems.append(f"open file descriptors grew by {fds} after the warm-up")
    if segs > 0 or shm > 0:
        problems.append(f"/dev/shm grew by {segs} segment(s), {shm:+.1f} MB after the warm-up")
    return GrowthCheck(
        warmup_s=warmup_s,
        window_s=round(t_last - t_first, 1),
        bound_pct=bound_pct,
        floor_mb=floor_mb,
        floors_mb=dict(floors_mb or {}),
        processes=procs,
        fds_growth=fds,
        shm_segments_growth=segs,
        shm_size_growth_mb=round(shm, 2),
        passed=not problems,
        problems=problems,
        level_window_s=round(w, 1),
    )
