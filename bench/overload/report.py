"""``bench overload`` results: the JSON document and the terminal tables."""

from __future__ import annotations

import math
from typing import Literal

import msgspec
from rich.console import Console

from bench.lib.report import table
from bench.lib.stats import Summary
from bench.load.report import LoadHeader, fmt
from bench.overload.classify import OverloadLevel, OverloadVerdict
from bench.overload.shares import MIN_OF_FAIR, MIN_SHARE_REALTIME, KeyShare
from bench.overload.timeline import LeadSample

SCHEMA = "orpheus-serve/bench-overload/1"

Scenario = Literal["levels", "fairness", "both"]


class Phase(msgspec.Struct, frozen=True, kw_only=True):
    """One level of an arm on the timeline (seconds from the arm's start)."""

    label: str
    clients: int
    """Closed-loop clients offering load (both keys' in the fairness scenario)."""
    start: float
    end: float
    cpu_cores: dict[str, float] = {}
    """Cores the server's parts (gateway, codec, llm with vLLM's processes, other) and the
    benchmark itself used over the phase (``bench.overload.cpu``; empty where unread)."""


class Timeline(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float
    """How often the gauges were scraped and the lead sampled."""
    gauges: dict[str, list[list[float]]]
    """Per scraped gauge (bench.overload.timeline.GAUGES), ``[t, value]`` pairs."""
    scrape_errors: int
    lead: list[LeadSample]
    """The playing streams' audio lead over their players, every scrape interval."""
    phases: list[Phase]


class ArmResult(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    overrides: list[str]
    """The arm's own ``--set`` overrides (after the shared ones)."""
    argv: list[str]
    log: str
    ready_after_s: float | None
    warmup_level: OverloadLevel | None
    """Run first and discarded."""
    levels: list[OverloadLevel]
    verdict: OverloadVerdict | None
    fairness: list[OverloadLevel]
    """The fairness scenario's mixed phases: per phase the flooding key's level, then each
    light key's."""
    timeline: Timeline
    solo: list[OverloadLevel] = []
    """The fairness scenario: each light key alone before each mixed phase."""
    shares: list[KeyShare] = []
    """The fairness scenario: each key of each mixed phase against its fair share."""


class OverloadReport(LoadHeader, kw_only=True):
    schema: str = SCHEMA
    model: str
    device: str
    scenario: Scenario
    arms: list[ArmResult]


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{x * 100:.1f}%"


def _ms(s: Summary, *qs: str) -> str:
    return "/".join("-" if math.isnan(getattr(s, q)) else f"{getattr(s, q) * 1000:.0f}" for q in qs)


def _s(s: Summary, *qs: str) -> str:
    return "/".join("-" if math.isnan(getattr(s, q)) else f"{getattr(s, q):.2f}" for q in qs)


def _row(lv: OverloadLevel) -> tuple[str, ...]:
    return (
        lv.label,
        str(lv.answered),
        str(lv.realtime),
        _pct(lv.share_realtime),
        fmt(lv.realtime_per_s),
        str(lv.refused),
        _ms(lv.refusal_s, "p50", "p99"),
        str(lv.failed),
        _ms(lv.ttfb_s, "p50", "p99"),
        fmt(lv.audio_s_per_s),
        _s(lv.first_gap_s, "p50", "p90"),
    )


COLUMNS = (
    "clients",
    "answered",
    "real-time",
    "share real-time",
    "real-time streams/s",
    "refused",
    "refusal ms p50/p99",
    "failed",
    "TTFB ms p50/p99",
    "audio s/s",
    "first gap s p50/p90",
)


def arm_table(arm: ArmResult) -> object:
    rows: list[tuple[str, ...] | None] = []
    if arm.warmup_level is not None:
        warm = _row(arm.warmup_level)
        rows += [(f"{warm[0]} (discarded)", *warm[1:]), None]
    rows += [_row(lv) for lv in arm.levels]
    if arm.solo:
        if rows:
            rows.append(None)
        rows += [_row(lv) for lv in arm.solo]
    if arm.fairness:
        if rows:
            rows.append(None)
        rows += [_row(lv) for lv in arm.fairness]
    title = f"arm {arm.name}: {' '.join(arm.overrides) or '(defaults)'}"
    return table(title, COLUMNS, rows, left=("clients",), title_justify="left")


def verdict_line(arm: ArmResult) -> str | None:
    v = arm.verdict
    if v is None:
        return None
    mark = "[green]held[/]" if v.held else "[red]not held[/]"
    refusal = "-" if math.isnan(v.refusal_p99_s) else f"{v.refusal_p99_s * 1000:.0f} ms"
    return (
        f"arm {arm.name} at {v.level}: {_pct(v.share_realtime)} of answered streams real-time, "
        f"real-time streams/s {_pct(v.goodput_ratio)} of the best level's ({v.best_level}), "
        f"refusal p99 {refusal}: goodput {mark} (goal: >= 95%, >= 80%, < 1 s)"
    )


SHARE_COLUMNS = (
    "phase",
    "key",
    "clients",
    "weight",
    "real-time streams/s",
    "share real-time",
    "solo streams/s",
    "fair streams/s",
    "of min(fair, solo)",
    "refused by code",
    "held",
)


def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{c} {n}" for c, n in sorted(codes.items())) or "-"


def shares_table(arm: ArmResult) -> object:
    rows: list[tuple[str, ...] | None] = []
    for s in arm.shares:
        if rows and s.key == arm.shares[0].key:
            rows.append(None)
        rows.append(
            (
                s.case,
                s.key,
                str(s.clients),
                f"{s.weight:g}",
                fmt(s.realtime_per_s),
                _pct(s.share_realtime),
                fmt(s.solo_realtime_per_s),
                fmt(s.fair_realtime_per_s),
                _pct(s.of_bound),
                _codes(s.refusal_codes),
                "-" if s.held is None else ("yes" if s.held else "no"),
            )
        )
    title = (
        f"arm {arm.name}, fair shares (a light key holds its share at >= "
        f"{MIN_OF_FAIR:.0%} of min(fair, solo) and >= {MIN_SHARE_REALTIME:.0%} real-time)"
    )
    return table(title, SHARE_COLUMNS, rows, left=("phase", "key"), title_justify="left")


def fairness_line(arm: ArmResult) -> str | None:
    """The flooding key against the single one: the single key's streams should stay
    real-time."""
    if len(arm.fairness) != 2:
        return None
    flood, single = arm.fairness
    return (
        f"arm {arm.name}, fairness: key B ({single.concurrency} client) "
        f"{_pct(single.share_realtime)} real-time, TTFB p50/p99 {_ms(single.ttfb_s, 'p50', 'p99')}"
        f" ms, {single.refused} refused; key A ({flood.concurrency} clients) "
        f"{_pct(flood.share_realtime)} real-time, {flood.refused} refused"
    )


def arm_lines(arm: ArmResult) -> list[str]:
    """The verdict and fairness lines under an arm's table."""
    return [line for line in (verdict_line(arm), fairness_line(arm)) if line is not None]


def print_report(console: Console, report: OverloadReport) -> None:
    for arm in report.arms:
        console.print(arm_table(arm))
        if arm.shares:
            console.print(shares_table(arm))
        for line in arm_lines(arm):
            console.print(line)
        if arm.timeline.scrape_errors:
            console.print(f"arm {arm.name}: {arm.timeline.scrape_errors} failed /metrics scrapes")
    console.print(
        f"real-time: answered, TTFB < {report.slo.ttfb_s * 1000:.0f} ms from the scheduled "
        f"send and no underrun with a {report.slo.jitter_buffer_s * 1000:.0f} ms jitter buffer; "
        "refused: 429/503"
    )
