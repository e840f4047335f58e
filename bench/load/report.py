"""Load results as a terminal table and a JSON document."""

from __future__ import annotations

import math
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from bench.lib.environment import Machine, Versions
from bench.lib.report import table
from bench.load.criteria import Capacity, all_criteria, passes
from bench.load.search import SearchResult
from bench.load.summary import LevelResult, Slo, budget_key

SCHEMA = "orpheus-serve/bench-load/1"


class LoadHeader(msgspec.Struct, kw_only=True):
    """What a load result begins with (``bench load`` and ``bench compare``)."""

    schema: str
    created: str
    machine: Machine
    versions: Versions
    config: dict[str, Any]
    corpus: dict[str, object]
    slo: Slo


class LoadReport(LoadHeader, kw_only=True):
    schema: str = SCHEMA
    target: str
    """What was measured: the URL or ZeroMQ endpoint, and the server's name."""
    levels: list[LevelResult]
    """The measured levels (the warm-up level is not one of them)."""
    search: SearchResult | None = None
    capacities: list[Capacity] = []
    """Under each criterion (published, real-time, interactive), over ``levels``: the largest
    measured passing level (bench.load.criteria)."""
    warmup_level: LevelResult | None = None
    """The level run before the first measured one, discarded: no capacity counts it."""


def _ms(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 1000:.0f}"


def fmt(x: float | None, digits: int = 2) -> str:
    """A number for a table: "-" when there is none (None or NaN)."""
    return "-" if x is None or math.isnan(x) else f"{x:.{digits}f}"


def _verdicts(r: LevelResult, slo: Slo) -> str:
    return "/".join("[green]yes[/]" if passes(r, c) else "[red]no[/]" for c in all_criteria(slo))


def _level_row(r: LevelResult, slo: Slo, *, warmup: bool = False) -> tuple[str, ...]:
    t = r.ttfb_s
    budget = budget_key(slo.ttfb_s)
    return (
        f"warm-up {r.label} (discarded)" if warmup else r.label,
        f"{r.ok}/{r.requests}",
        f"{r.short}/{r.long}",
        fmt(r.load_held, 1),
        "/".join(_ms(x) for x in (t.mean, t.p50, t.p90, t.p99)),
        "/".join(fmt(x) for x in (r.rtf.mean, r.rtf.p90, r.rtf.p99)),
        f"{r.underruns} ({r.underrun_streams})",
        _ms(r.worst_lag_s.p99),
        fmt(r.tokens_per_s, 0),
        fmt(r.audio_s_per_s),
        fmt(r.goodput_per_s.get(budget, math.nan)),
        "-" if warmup else _verdicts(r, slo),
    )


def levels_table(
    title: str, levels: list[LevelResult], slo: Slo, warmup_level: LevelResult | None = None
) -> Table:
    budget = budget_key(slo.ttfb_s)
    columns = (
        "load",
        "ok/req",
        "short/long",
        "held",
        "TTFB ms mean/p50/p90/p99",
        "RTF mean/p90/p99",
        "underruns (streams)",
        "worst lag ms p99",
        "tokens/s",
        "audio s/s",
        f"goodput/s @{budget} ms",
        "pass pub/rt/int",
    )
    rows: list[tuple[str, ...] | None] = []
    if warmup_level is not None:
        rows += [_level_row(warmup_level, slo, warmup=True), None]
    rows += [_level_row(r, slo) for r in levels]
    return table(title, columns, rows, title_justify="left")


def capacity_line(cap: Capacity) -> str:
    """One capacity in words: its figure, its criterion and what bounded it."""
    text = (
        f"capacity, {cap.criterion} ({cap.definition}): "
        f"[bold]{'>= ' if cap.at_least else ''}{cap.concurrency}[/bold] streams"
    )
    if cap.first_failure is not None:
        text += f"; bounded at c={cap.first_failure} by {'; '.join(cap.bounded_by)}"
    else:
        text += "; no measured level above it failed"
    if cap.failing_below:
        text += f" (but failed at {', '.join(f'c={c}' for c in cap.failing_below)})"
    return text


def print_report(console: Console, report: LoadReport) -> None:
    console.print(
        levels_table(f"load: {report.target}", report.levels, report.slo, report.warmup_level)
    )
    mix = report.corpus
    console.print(
        f"corpus: {mix['short_texts']} short ({mix['short_words']} words) and "
        f"{mix['long_texts']} long texts ({mix['long_words']} words), long fraction "
        f"{mix['long_fraction']}; TTFB from the scheduled send; jitter buffer "
        f"{report.slo.jitter_buffer_s * 1000:.0f} ms"
    )
    if report.search is not None:
        console.print(f"search probed, in order: {', '.join(map(str, report.search.probes))}")
    for cap in report.capacities:
        console.print(capacity_line(cap))
