"""The three pass criteria of a load level, and the capacity each gives over measured levels.

- *published*: every request ok, p99 RTF < 1, **mean** TTFB < 1 s: the criterion of the
  published 216-stream result, so that our number compares with it;
- *real-time* (ours, the default): every request ok, p99 RTF < 1, **p99** TTFB < 1 s, and no
  playback underrun with the 100 ms jitter buffer;
- *interactive*: real-time, and p99 TTFB < 500 ms.

A level in which no request finished fails all three. A capacity is always the largest
*measured* passing level, never an interpolation: the search (bench.load.search) only
chooses which levels to measure, and the figure comes from :func:`capacities_of`, which
the recomputation of a stored result (``bench load --recompute``) uses too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import msgspec

from bench.load.summary import LevelResult, Slo

CriterionName = Literal["published", "real-time", "interactive"]
CRITERIA: tuple[CriterionName, ...] = ("published", "real-time", "interactive")


class Criterion(msgspec.Struct, frozen=True, kw_only=True):
    name: CriterionName
    ttfb_stat: Literal["mean", "p99"]
    ttfb_budget_s: float
    rtf: float
    no_underrun: bool

    def describe(self) -> str:
        text = (
            f"every request ok, p99 RTF < {self.rtf:g}, {self.ttfb_stat} TTFB < "
            f"{self.ttfb_budget_s * 1000:.0f} ms"
        )
        return text + (", no underrun" if self.no_underrun else "")


def criterion(name: CriterionName, slo: Slo) -> Criterion:
    """The criterion ``name`` under ``slo`` (its RTF target, main TTFB budget, interactive
    budget)."""
    if name == "published":
        return Criterion(
            name=name, ttfb_stat="mean", ttfb_budget_s=slo.ttfb_s, rtf=slo.rtf, no_underrun=False
        )
    if name == "real-time":
        return Criterion(
            name=name, ttfb_stat="p99", ttfb_budget_s=slo.ttfb_s, rtf=slo.rtf, no_underrun=True
        )
    if name == "interactive":
        budget = min(slo.interactive_ttfb_s, slo.ttfb_s)
        return Criterion(
            name=name, ttfb_stat="p99", ttfb_budget_s=budget, rtf=slo.rtf, no_underrun=True
        )
    raise ValueError(f"unknown criterion {name!r} (one of {', '.join(CRITERIA)})")


def all_criteria(slo: Slo) -> list[Criterion]:
    return [criterion(n, slo) for n in CRITERIA]


def failed_targets(result: LevelResult, crit: Criterion) -> list[str]:
    """Why ``result`` fails ``crit``, one reason per missed target (empty: it passes)."""
    if result.ok == 0:  # nothing else to say: no TTFB, no RTF
        if result.requests == 0:
            return ["no request finished (no measured request)"]
        return [f"no request finished ({result.requests} measured: {dict(result.outcomes)})"]
    reasons: list[str] = []
    failed = result.requests - result.ok
    if failed:
        reasons.append(f"{failed} failed requests {dict(result.outcomes)}")
    if not result.rtf.p99 < crit.rtf:
        reasons.append(f"p99 RTF {result.rtf.p99:.2f} >= {crit.rtf:g}")
    ttfb = getattr(result.ttfb_s, crit.ttfb_stat)
    if not ttfb < crit.ttfb_budget_s:
        shown = "-" if math.isnan(ttfb) else f"{ttfb * 1000:.0f}"
        reasons.append(f"{crit.ttfb_stat} TTFB {shown} ms >= {crit.ttfb_budget_s * 1000:.0f} ms")
    if crit.no_underrun and result.underruns:
        reasons.append(f"{result.underruns} underruns in {result.underrun_streams} streams")
    return reasons


def passes(result: LevelResult, crit: Criterion) -> bool:
    return not failed_targets(result, crit)


class Capacity(msgspec.Struct, frozen=True, kw_only=True):
    criterion: CriterionName
    definition: str
    """The criterion in words, with its budgets."""
    concurrency: int
    """The largest measured passing closed-loop level (0: none passed)."""
    at_least: bool
    """True when no measured level above the capacity failed (the true capacity may be
    higher: the search stopped at its maximum, or nothing above was measured)."""
    first_failure: int | None
    """The smallest measured failing level above the capacity."""
    bounded_by: list[str]
    """Which targets that level missed: what bounded this capacity."""
    failing_below: list[int] = []
    """Measured levels below the capacity that failed (noise, or a stall): listed so that a
    capacity above a failure is never silent."""


def closed_levels(levels: Sequence[LevelResult]) -> dict[int, LevelResult]:
    """Closed-loop levels by concurrency (the last one wins when a level repeats)."""
    return {lv.concurrency: lv for lv in levels if lv.mode == "closed" and lv.concurrency}


def capacity_of(levels: Sequence[LevelResult], crit: Criterion) -> Capacity:
    """The capacity under ``crit`` over measured closed-loop ``levels`` (no warm-up level
    belongs in them)."""
    by_c = closed_levels(levels)
    ok = [c for c, lv in by_c.items() if passes(lv, crit)]
    cap = max(ok, default=0)
    above = sorted(c for c, lv in by_c.items() if c > cap and not passes(lv, crit))
    below = sorted(c for c, lv in by_c.items() if c < cap and not passes(lv, crit))
    first = above[0] if above else None
    return Capacity(
        criterion=crit.name,
        definition=crit.describe(),
        concurrency=cap,
        at_least=first is None,
        first_failure=first,
        bounded_by=failed_targets(by_c[first], crit) if first is not None else [],
        failing_below=below,
    )


def capacities_of(levels: Sequence[LevelResult], slo: Slo) -> list[Capacity]:
    """The capacity under each criterion, in the order of :data:`CRITERIA`."""
    return [capacity_of(levels, c) for c in all_criteria(slo)]


def by_criterion(capacities: Sequence[Capacity], name: CriterionName) -> Capacity:
    for cap in capacities:
        if cap.criterion == name:
            return cap
    raise KeyError(name)
