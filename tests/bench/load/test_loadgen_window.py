"""Stable-window trimming and level summaries against hand-computed cases."""

from __future__ import annotations

import pytest

from bench.load.runner import LevelPlan
from bench.load.summary import LevelRun, Slo, summarize
from bench.load.trace import Outcome, StreamTrace, stream_metrics
from bench.load.window import (
    TrimPolicy,
    Window,
    bytes_in_window,
    completions_in_window,
    mean_active,
    stable_window,
)

SECOND = 48_000  # bytes of 1 s of 24 kHz int16 audio


def trace(
    index: int,
    scheduled: float,
    arrivals: list[tuple[float, int]],
    *,
    measured: bool = True,
    outcome: Outcome = Outcome.OK,
    error: str = "",
    sent: float | None = None,
    done: float | None = None,
    kind: str = "short",
) -> StreamTrace:
    t = StreamTrace(index=index, kind=kind, chars=40, scheduled=scheduled, measured=measured)
    t.sent = scheduled if sent is None else sent
    for at, n in arrivals:
        t.record(at, n)
    t.outcome, t.error = outcome, error
    t.status = 200 if outcome is Outcome.OK else 503
    t.done = done if done is not None else (arrivals[-1][0] if arrivals else scheduled)
    return t


def test_trim_policy_closed_loop_skips_first_wave() -> None:
    trim = LevelPlan(duration_s=60).trim("closed", concurrency=8)
    assert trim == TrimPolicy(skip_first=8, warmup_s=6.0, duration_s=60)
    assert not trim.is_measured(index=7, offset_s=30.0, measured_so_far=0)
    assert not trim.is_measured(index=8, offset_s=5.9, measured_so_far=0)
    assert trim.is_measured(index=8, offset_s=6.0, measured_so_far=0)
    assert not trim.is_measured(index=9, offset_s=60.0, measured_so_far=1)  # ramp-down filler


def test_trim_policy_open_loop_warmup_and_budget() -> None:
    trim = LevelPlan(duration_s=50, max_requests=3).trim("open")
    assert trim.warmup_s == pytest.approx(5.0)
    assert not trim.is_measured(index=0, offset_s=4.9, measured_so_far=0)
    assert trim.is_measured(index=1, offset_s=5.0, measured_so_far=2)
    assert not trim.is_measured(index=2, offset_s=6.0, measured_so_far=3)


def test_window_bytes_completions_and_load_held() -> None:
    warm = trace(0, 0.0, [(1.0, 100), (3.0, 200)], measured=False, done=4.0)
    a = trace(1, 2.0, [(4.0, 300)], done=5.0)
    b = trace(2, 3.0, [(9.0, 400)], done=9.0)
    filler = trace(3, 8.0, [(10.0, 500)], measured=False, outcome=Outcome.CANCELLED, done=10.0)
    traces = [warm, a, b, filler]
    w = stable_window(2.0, 9.0)
    assert w == Window(2.0, 9.0)
    assert bytes_in_window(traces, w) == 200 + 300 + 400
    assert completions_in_window(traces, w) == 3  # warm-up, a, b; not the cancelled filler
    # busy: warm 2..4 (2 s), a 2..5 (3), b 3..9 (6), filler 8..9 (1) over 7 s
    assert mean_active(traces, w) == pytest.approx(12.0 / 7.0)


def test_empty_window() -> None:
    assert stable_window(5.0, 5.0) is None


def test_ttfb_and_rtf_run_from_the_scheduled_time() -> None:
    t = trace(0, 10.0, [(10.5, SECOND), (11.0, SECOND)], sent=10.4)
    m = stream_metrics(t, jitter_buffer_s=0.1)
    assert m.ttfb_s == pytest.approx(0.5)  # not 0.1 from the actual send
    assert m.send_lag_s == pytest.approx(0.4)
    assert m.rtf == pytest.approx(1.0 / 2.0)
    assert m.audio_s == pytest.approx(2.0)


def test_summarize_hand_computed_level() -> None:
    traces = [
        # ttfb 0.2, 1 s audio, rtf 0.6, on time: good at 500 ms and 1 s
        trace(0, 10.0, [(10.2, SECOND // 2), (10.6, SECOND // 2)]),
        # ttfb 0.7, rtf 0.7: good at 1 s only
        trace(1, 10.0, [(10.7, SECOND)], kind="long"),
        # ttfb 0.3, second half needed at 11.3 + 0.1 + 0.5 = 11.9, came at 12.0: underrun;
        # rtf 1.0 is not below 1
        trace(2, 11.0, [(11.3, SECOND // 2), (12.0, SECOND // 2)]),
        trace(3, 11.5, [], outcome=Outcome.HTTP_ERROR, error="503 busy"),  # over capacity
    ]
    run = LevelRun(
        mode="closed",
        concurrency=2,
        started=9.0,
        measure_start=10.0,
        measure_end=12.0,
        finished=12.5,
        traces=traces,
    )
    r = summarize(run, Slo(ttfb_s=1.0, ttfb_report_s=(0.5, 1.0), jitter_buffer_s=0.1))
    assert (r.requests, r.ok, r.short, r.long) == (4, 3, 3, 1)
    assert r.outcomes == {"ok": 3, "http_error": 1}
    assert r.errors == {"503 busy": 1}
    assert r.ttfb_s.mean == pytest.approx(0.4)
    assert r.ttfb_s.p50 == pytest.approx(0.3)
    assert r.rtf.mean == pytest.approx((0.6 + 0.7 + 1.0) / 3)
    assert r.rtf.p99 == pytest.approx(0.7 + 0.98 * 0.3)
    assert (r.underruns, r.underrun_streams) == (1, 1)
    assert r.window_s == pytest.approx(2.0)  # 10.0 .. 12.0
    assert r.audio_s_per_s == pytest.approx(1.5)  # 3 s of audio in 2 s
    assert r.tokens_per_s == pytest.approx(3 * 24_000 / 2048 * 7 / 2.0)
    assert r.streams_per_s == pytest.approx(1.5)
    assert r.goodput_per_s["1000"] == pytest.approx(1.5 * 2 / 4)
    assert r.goodput_per_s["500"] == pytest.approx(1.5 * 1 / 4)
    assert r.passes == {"500": False, "1000": False}  # a failed request fails the level


def test_level_passes_only_when_every_target_is_met() -> None:
    traces = [
        trace(i, 10.0 + i, [(10.2 + i, SECOND // 2), (10.4 + i, SECOND // 2)]) for i in range(5)
    ]
    run = LevelRun(
        mode="closed",
        concurrency=1,
        started=9.0,
        measure_start=10.0,
        measure_end=14.4,
        finished=15.0,
        traces=traces,
    )
    r = summarize(run, Slo())
    assert r.passes == {"500": True, "1000": True}
    assert r.rtf.p99 == pytest.approx(0.4)
    slow = summarize(run, Slo(ttfb_s=0.15, ttfb_report_s=()))
    assert slow.passes == {"150": False}


def test_a_server_too_slow_to_finish_anything_still_has_a_throughput() -> None:
    # Two first-wave streams, still running when the level ends: nothing is measured,
    # but 0.5 s + 0.5 s of audio arrived inside the 4 s window after warm-up.
    traces = [
        trace(i, 0.0, [(0.5, SECOND // 2), (3.0, SECOND // 2), (9.0, SECOND)], measured=False)
        for i in range(2)
    ]
    for t in traces:
        t.outcome, t.done = Outcome.CANCELLED, 6.0
    run = LevelRun(
        mode="closed",
        concurrency=2,
        started=0.0,
        measure_start=1.0,
        measure_end=5.0,
        finished=6.0,
        traces=traces,
    )
    r = summarize(run, Slo())
    assert r.requests == 0 and r.ttfb_s.n == 0
    assert r.audio_s_per_s == pytest.approx(1.0 / 4.0)
    assert r.load_held == pytest.approx(2.0)
    assert r.passes == {"500": False, "1000": False}
