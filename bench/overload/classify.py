"""From one closed-loop level's traces to what overload costs its users.

A stream is *real-time* when it was answered with audio, its first byte came within the
TTFB budget of its scheduled send, and a player that started after a jitter buffer never ran
dry (``bench.load.playback``). Under overload what matters is how many such streams the node
delivers (real-time streams per second), which share of the answered ones they are, and how
fast the others are told to go away (refusal latency: scheduled send to the 429/503).
"""

from __future__ import annotations

import math
import re
from collections import Counter

import msgspec

from bench.lib.stats import Summary
from bench.load.summary import LevelRun, Slo
from bench.load.trace import Outcome, StreamMetrics, StreamTrace, audio_seconds, stream_metrics
from bench.load.window import bytes_in_window, stable_window

REFUSAL_STATUSES = frozenset({429, 503})
"""Answers that say "full, come back later" (both carry Retry-After)."""

MAX_ERROR_KINDS = 5
_CODE = re.compile(r'"(?:code|status)"\s*:\s*"([A-Za-z_]+)"')
"""A refusal body's error code: OpenAI's ``error.code``, ElevenLabs' ``detail.status``."""


def refusal_code(trace: StreamTrace) -> str:
    """The code a refusal's body names (``server_busy``, ``too_many_concurrent_requests``
    ...), else its HTTP status."""
    m = _CODE.search(trace.error)
    return m.group(1) if m else str(trace.status)


class OverloadLevel(msgspec.Struct, frozen=True, kw_only=True):
    label: str
    """``c=N``, or in the fairness scenario ``key A c=N``."""
    concurrency: int
    key: str | None = None
    """The API key the level's clients sent (fairness scenario)."""
    requests: int
    """Measured requests (warm-up and fillers excluded, bench.load.window)."""
    answered: int
    """Measured requests answered with audio to the end."""
    realtime: int
    """Answered streams with TTFB under the budget and no underrun."""
    share_realtime: float
    """``realtime / answered`` (NaN when nothing was answered)."""
    realtime_per_s: float
    """Real-time streams (any request of the level) that ended inside the stable window,
    per second of it."""
    refused: int
    """Measured requests answered 429 or 503."""
    failed: int
    """Measured requests that neither played nor were refused: broken, timed out, no audio,
    other HTTP errors."""
    refusal_s: Summary
    """Scheduled send to the refusal's answer, over the refused requests."""
    ttfb_s: Summary
    """Over the answered streams."""
    audio_s_per_s: float
    """Audio seconds delivered per second of the stable window (real-time or not)."""
    window_s: float
    refusals: dict[str, int]
    """Refused requests by HTTP status."""
    refusal_codes: dict[str, int] = {}
    """Refused requests by the error code of their body (``refusal_code``)."""
    errors: dict[str, int]
    """The most frequent messages of failed (not refused) requests."""
    first_gap_s: Summary = msgspec.field(default_factory=lambda: Summary.of([]))
    """Over the answered streams that underran: audio position of their first gap. Near 0
    the streams break at their start (first chunk against the jitter buffer); spread out,
    the node is short of rate."""


def is_realtime(m: StreamMetrics, slo: Slo) -> bool:
    """Answered with audio, first byte within the TTFB budget, never an underrun."""
    return m.ok and m.ttfb_s is not None and m.ttfb_s < slo.ttfb_s and m.underruns == 0


def is_refused(trace: StreamTrace) -> bool:
    return trace.outcome is Outcome.HTTP_ERROR and trace.status in REFUSAL_STATUSES


def refusal_latency(trace: StreamTrace) -> float | None:
    """How long a refused request waited for its answer, from its scheduled send (None when
    it was not refused)."""
    if not is_refused(trace) or trace.done is None:
        return None
    return trace.done - trace.scheduled


def aggregate(run: LevelRun, slo: Slo, *, label: str, key: str | None = None) -> OverloadLevel:
    """One closed-loop level's numbers (``run.concurrency`` clients)."""
    metrics = {t.index: stream_metrics(t, jitter_buffer_s=slo.jitter_buffer_s) for t in run.traces}
    measured = [t for t in run.traces if t.measured]
    answered = [metrics[t.index] for t in measured if metrics[t.index].ok]
    realtime = sum(1 for m in answered if is_realtime(m, slo))
    refused = [t for t in measured if is_refused(t)]
    window = stable_window(run.measure_start, run.measure_end)
    if window is not None:
        ended_realtime = sum(
            1
            for t in run.traces
            if t.done is not None
            and window.start <= t.done <= window.end
            and is_realtime(metrics[t.index], slo)
        )
        realtime_per_s = ended_realtime / window.length
        audio_rate = audio_seconds(bytes_in_window(run.traces, window)) / window.length
    else:
        realtime_per_s = audio_rate = math.nan
    failed = [t for t in measured if not metrics[t.index].ok and not is_refused(t)]
    return OverloadLevel(
        label=label,
        concurrency=run.concurrency or 0,
        key=key,
        requests=len(measured),
        answered=len(answered),
        realtime=realtime,
        share_realtime=realtime / len(answered) if answered else math.nan,
        realtime_per_s=realtime_per_s,
        refused=len(refused),
        failed=len(failed),
        refusal_s=Summary.of([lat for t in refused if (lat := refusal_latency(t)) is not None]),
        ttfb_s=Summary.of([m.ttfb_s for m in answered if m.ttfb_s is not None]),
        audio_s_per_s=audio_rate,
        window_s=window.length if window is not None else 0.0,
        refusals=dict(Counter(str(t.status) for t in refused)),
        refusal_codes=dict(Counter(refusal_code(t) for t in refused)),
        errors=dict(
            Counter(t.error or str(metrics[t.index].outcome) for t in failed).most_common(
                MAX_ERROR_KINDS
            )
        ),
        first_gap_s=Summary.of([m.first_gap_s for m in answered if m.first_gap_s is not None]),
    )


class OverloadVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """The issue's goal at the highest level of an arm: most answered streams real-time,
    goodput held near the best level's, refusals answered at once."""

    level: str
    best_level: str
    share_realtime: float
    goodput_ratio: float
    """The level's real-time streams/s over the best level's."""
    refusal_p99_s: float
    held: bool
    """share >= 95 %, goodput ratio >= 80 %, refusal p99 < 1 s (or nothing refused)."""


MIN_SHARE = 0.95
MIN_GOODPUT_RATIO = 0.8
MAX_REFUSAL_S = 1.0


def verdict(levels: list[OverloadLevel]) -> OverloadVerdict | None:
    """Judged at the level with the most clients, against the level with the most real-time
    streams per second; None without a level that delivered any."""
    rated = [lv for lv in levels if not math.isnan(lv.realtime_per_s)]
    if not rated:
        return None
    top = max(levels, key=lambda lv: lv.concurrency)
    best = max(rated, key=lambda lv: lv.realtime_per_s)
    ratio = top.realtime_per_s / best.realtime_per_s if best.realtime_per_s > 0 else math.nan
    refusal = top.refusal_s.p99
    held = (
        top.share_realtime >= MIN_SHARE
        and ratio >= MIN_GOODPUT_RATIO
        and (top.refused == 0 or refusal < MAX_REFUSAL_S)
    )
    return OverloadVerdict(
        level=top.label,
        best_level=best.label,
        share_realtime=top.share_realtime,
        goodput_ratio=ratio,
        refusal_p99_s=refusal,
        held=held,
    )
