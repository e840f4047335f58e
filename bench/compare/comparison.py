"""Two servers' load results -> the ratios ``bench compare`` reports (pure, no I/O)."""

from __future__ import annotations

import math
import statistics
from typing import Literal

import msgspec
from rich.table import Table

from bench.lib.report import table
from bench.load.criteria import by_criterion
from bench.load.report import LoadHeader, fmt
from bench.load.search import SearchResult
from bench.load.summary import LevelResult, Slo

SCHEMA = "orpheus-serve/bench-compare/1"
Variant = Literal["baseline", "ours"]
NAMES: dict[Variant, str] = {"baseline": "baseline (reference approach)", "ours": "orpheus-serve"}
SHORT_NAMES: dict[Variant, str] = {"baseline": "baseline", "ours": "orpheus-serve"}


class VariantRun(msgspec.Struct, kw_only=True):
    variant: Variant
    round: int
    ready_after_s: float | None
    levels: list[LevelResult]
    search: SearchResult | None = None
    log: str


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    concurrency: int
    baseline_audio_s_per_s: float
    ours_audio_s_per_s: float
    ratio: float | None
    """ours / baseline; the median of the rounds' ratios when there are several rounds."""
    round_ratios: list[float | None]


class CapacityComparison(msgspec.Struct, frozen=True, kw_only=True):
    method: str
    """"search" (bracketing search) or "levels" (largest passing level that was run)."""
    ttfb_budget_s: float
    baseline: int
    ours: int
    ratio: float | None
    """None when the baseline's capacity is 0 (neither real time nor within budget)."""


class CompareReport(LoadHeader, kw_only=True):
    schema: str = SCHEMA
    model: str
    codec_model: str
    device: str
    concurrency: int
    """The headline level: the highest concurrency compared."""
    baseline_audio_s_per_s: float
    ours_audio_s_per_s: float
    ratio: float | None
    comparisons: list[Comparison]
    capacity: CapacityComparison
    runs: list[VariantRun]
    names: dict[str, str] | None = None
    """The sides' names when the baseline side is orpheus-serve too (``--against-set``)."""


def _ratio(ours: float, baseline: float) -> float | None:
    if math.isnan(ours) or math.isnan(baseline) or baseline <= 0:
        return None
    return ours / baseline


def _median(values: list[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def compare_levels(runs: list[VariantRun], concurrencies: list[int]) -> list[Comparison]:
    out: list[Comparison] = []
    rounds = sorted({r.round for r in runs})

    def rate(variant: Variant, rnd: int, c: int) -> float:
        for run in runs:
            if run.variant == variant and run.round == rnd:
                for lv in run.levels:
                    if lv.mode == "closed" and lv.concurrency == c:
                        return lv.audio_s_per_s
        return math.nan

    for c in concurrencies:
        base = [rate("baseline", r, c) for r in rounds]
        ours = [rate("ours", r, c) for r in rounds]
        ratios = [_ratio(o, b) for o, b in zip(ours, base, strict=True)]
        valid = [x for x in ratios if x is not None]
        out.append(
            Comparison(
                concurrency=c,
                baseline_audio_s_per_s=_median(base),
                ours_audio_s_per_s=_median(ours),
                ratio=statistics.median(valid) if valid else None,
                round_ratios=ratios,
            )
        )
    return out


def _level_capacity(levels: list[LevelResult], budget_s: float) -> int:
    passing = [
        lv.concurrency or 0 for lv in levels if lv.mode == "closed" and lv.passes_at(budget_s)
    ]
    return max(passing, default=0)


def compare_capacity(runs: list[VariantRun], slo: Slo) -> CapacityComparison:
    """Median over rounds of each side's capacity under the main TTFB budget."""

    def capacity(run: VariantRun) -> int:
        if run.search is not None:
            return by_criterion(run.search.capacities, "real-time").concurrency
        return _level_capacity(run.levels, slo.ttfb_s)

    searched = all(r.search is not None for r in runs)
    base = int(statistics.median(capacity(r) for r in runs if r.variant == "baseline"))
    ours = int(statistics.median(capacity(r) for r in runs if r.variant == "ours"))
    return CapacityComparison(
        method="search" if searched else "levels",
        ttfb_budget_s=slo.ttfb_s,
        baseline=base,
        ours=ours,
        ratio=ours / base if base > 0 else None,
    )


def comparison_table(
    comparisons: list[Comparison],
    capacity: CapacityComparison,
    names: dict[Variant, str] | None = None,
) -> Table:
    """``names``: the two sides' short names (default: the baseline and orpheus-serve)."""
    base, ours = (names or SHORT_NAMES)["baseline"], (names or SHORT_NAMES)["ours"]
    t = table(
        f"{base} vs {ours} (closed loop)",
        ("concurrency", f"{base} audio s/s", f"{ours} audio s/s", "ratio", "rounds"),
        [
            (
                str(c.concurrency),
                fmt(c.baseline_audio_s_per_s, 3),
                fmt(c.ours_audio_s_per_s, 3),
                f"[bold]{fmt(c.ratio)}x[/bold]" if c.ratio is not None else "-",
                ", ".join(fmt(r) for r in c.round_ratios),
            )
            for c in comparisons
        ],
        title_justify="left",
    )
    t.caption = (
        f"capacity ({capacity.method}; p99 TTFB < {capacity.ttfb_budget_s * 1000:.0f} ms, "
        f"p99 RTF < 1, no underrun): {base} {capacity.baseline}, {ours} "
        f"{capacity.ours}, ratio {fmt(capacity.ratio)}"
    )
    return t
