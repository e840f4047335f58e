"""From the traces of one load level to the numbers a result reports."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec

from bench.lib.stats import Summary
from bench.load.trace import (
    StreamMetrics,
    StreamTrace,
    audio_seconds,
    stream_metrics,
    tokens_of_audio,
)
from bench.load.window import bytes_in_window, completions_in_window, mean_active, stable_window

MAX_ERROR_KINDS = 5


class Slo(msgspec.Struct, frozen=True, kw_only=True):
    """The targets a stream must meet to count as good (docs/benchmarks.md, *What it measures*)."""

    rtf: float = 1.0
    """p99 RTF must be below this."""
    ttfb_s: float = 1.0
    """p99 TTFB budget used for pass/fail and goodput."""
    ttfb_report_s: tuple[float, ...] = (0.5, 1.0)
    """Further TTFB budgets whose goodput and capacity are reported too."""
    jitter_buffer_s: float = 0.1
    interactive_ttfb_s: float = 0.5
    """p99 TTFB budget of the interactive criterion (bench.load.criteria)."""

    def stream_is_good(self, m: StreamMetrics, ttfb_budget_s: float | None = None) -> bool:
        budget = self.ttfb_s if ttfb_budget_s is None else ttfb_budget_s
        return (
            m.ok
            and m.ttfb_s is not None
            and m.ttfb_s < budget
            and m.rtf is not None
            and m.rtf < self.rtf
            and m.underruns == 0
        )


class LevelRun(msgspec.Struct, kw_only=True):
    """Raw record of one load level as the runner produced it."""

    mode: Literal["closed", "open"]
    concurrency: int | None = None
    rate: float | None = None
    started: float
    measure_start: float
    """Warm-up over: the throughput window opens."""
    measure_end: float
    """Every measured request finished (or the deadline): the window closes."""
    finished: float
    deadline_hit: bool = False
    traces: list[StreamTrace]


class LevelResult(msgspec.Struct, frozen=True, kw_only=True):
    mode: Literal["closed", "open"]
    concurrency: int | None
    rate: float | None
    requests: int
    """Measured requests (warm-up and fillers excluded)."""
    issued: int
    """All requests sent in the level, warm-up and fillers included."""
    ok: int
    outcomes: dict[str, int]
    errors: dict[str, int]
    """The most frequent error messages of failed measured requests, with their counts."""
    short: int
    long: int
    window_s: float
    """Length of the throughput window (warm-up to the end of the drain)."""
    load_held: float
    """Mean requests in flight inside the stable window."""
    ttfb_s: Summary
    rtf: Summary
    underruns: int
    underrun_streams: int
    worst_lag_s: Summary
    send_lag_s: Summary
    audio_s_per_s: float
    tokens_per_s: float
    streams_per_s: float
    goodput_per_s: dict[str, float]
    """Streams per second meeting every target, keyed by TTFB budget in ms ("1000")."""
    passes: dict[str, bool]
    """p99 RTF < target, p99 TTFB < budget, no underrun and no failed request, by budget."""
    deadline_hit: bool
    audio_s_mean: float

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.mode == "closed" else f"{self.rate:g}/s"

    def passes_at(self, ttfb_budget_s: float) -> bool:
        return self.passes[budget_key(ttfb_budget_s)]


def budget_key(ttfb_budget_s: float) -> str:
    return str(round(ttfb_budget_s * 1000))


def level_passes(
    metrics: Sequence[StreamMetrics], ttfb: Summary, rtf: Summary, slo: Slo, budget_s: float
) -> bool:
    return (
        len(metrics) > 0
        and all(m.ok for m in metrics)
        and all(m.underruns == 0 for m in metrics)
        and ttfb.p99 < budget_s
        and rtf.p99 < slo.rtf
    )


def summarize(run: LevelRun, slo: Slo) -> LevelResult:
    metrics = [
        stream_metrics(t, jitter_buffer_s=slo.jitter_buffer_s) for t in run.traces if t.measured
    ]
    ok = [m for m in metrics if m.ok]
    ttfb = Summary.of([m.ttfb_s for m in ok if m.ttfb_s is not None])
    rtf = Summary.of([m.rtf for m in ok if m.rtf is not None])
    window = stable_window(run.measure_start, run.measure_end)
    window_s = window.length if window is not None else 0.0
    if window is not None and window_s > 0:
        nbytes = bytes_in_window(run.traces, window)
        audio_rate = audio_seconds(nbytes) / window_s
        token_rate = tokens_of_audio(nbytes) / window_s
        stream_rate = completions_in_window(run.traces, window) / window_s
        held = mean_active(run.traces, window)
    else:
        audio_rate = token_rate = stream_rate = held = math.nan
    budgets = sorted({slo.ttfb_s, *slo.ttfb_report_s})
    goodput: dict[str, float] = {}
    passes: dict[str, bool] = {}
    for budget in budgets:
        good = sum(1 for m in metrics if slo.stream_is_good(m, budget))
        goodput[budget_key(budget)] = stream_rate * good / len(metrics) if metrics else 0.0
        passes[budget_key(budget)] = level_passes(metrics, ttfb, rtf, slo, budget)
    kinds = Counter(m.kind for m in metrics)
    return LevelResult(
        mode=run.mode,
        concurrency=run.concurrency,
        rate=run.rate,
        requests=len(metrics),
        issued=len(run.traces),
        ok=len(ok),
        outcomes=dict(Counter(str(m.outcome) for m in metrics)),
        errors=dict(
            Counter(
                t.error or str(t.outcome) for t in run.traces if t.measured and t.error
            ).most_common(MAX_ERROR_KINDS)
        ),
        short=kinds.get("short", 0),
        long=kinds.get("long", 0),
        window_s=window_s,
        load_held=held,
        ttfb_s=ttfb,
        rtf=rtf,
        underruns=sum(m.underruns for m in metrics),
        underrun_streams=sum(1 for m in metrics if m.underruns > 0),
        worst_lag_s=Summary.of([m.worst_lag_s for m in ok]),
        send_lag_s=Summary.of([m.send_lag_s for m in metrics if m.send_lag_s is not None]),
        audio_s_per_s=audio_rate,
        tokens_per_s=token_rate,
        streams_per_s=stream_rate,
        goodput_per_s=goodput,
        passes=passes,
        deadline_hit=run.deadline_hit,
        audio_s_mean=math.fsum(m.audio_s for m in ok) / len(ok) if ok else math.nan,
    )
