"""The three pass criteria and the capacity search, on levels whose outcome is known in
advance.

A synthetic level at concurrency ``c`` (see ``Oracle``) has its mean TTFB, p99 TTFB and
underruns set by thresholds, so that each criterion's boundary is where the test puts it.
"""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.lib.stats import Summary
from bench.load.criteria import (
    CRITERIA,
    all_criteria,
    capacities_of,
    capacity_of,
    criterion,
    failed_targets,
    passes,
)
from bench.load.recompute import recompute
from bench.load.search import CapacitySearch
from bench.load.summary import LevelResult, Slo

SLO = Slo(ttfb_s=1.0, ttfb_report_s=(0.5, 1.0), jitter_buffer_s=0.1, interactive_ttfb_s=0.5)
RESULTS = Path(__file__).resolve().parents[3] / "docs" / "results"


def level(
    c: int,
    *,
    mean: float = 0.2,
    p99: float = 0.3,
    rtf: float = 0.5,
    underruns: int = 0,
    requests: int = 10,
    ok: int | None = None,
) -> LevelResult:
    ok = requests if ok is None else ok
    nan = math.nan
    if ok:
        ttfb = Summary(n=ok, mean=mean, p50=mean, p90=p99, p99=p99, max=p99)
        rtfs = Summary(n=ok, mean=rtf, p50=rtf, p90=rtf, p99=rtf, max=rtf)
    else:  # what summarize() gives when no request finished
        ttfb = rtfs = Summary.of([])
    return LevelResult(
        mode="closed",
        concurrency=c,
        rate=None,
        requests=requests,
        issued=requests + c,
        ok=ok,
        outcomes={"ok": ok} | ({"timeout": requests - ok} if requests > ok else {}),
        errors={},
        short=requests,
        long=0,
        window_s=10.0,
        load_held=float(c),
        ttfb_s=ttfb,
        rtf=rtfs,
        underruns=underruns,
        underrun_streams=min(underruns, ok),
        worst_lag_s=Summary.of([]),
        send_lag_s=Summary.of([]),
        audio_s_per_s=nan,
        tokens_per_s=nan,
        streams_per_s=nan,
        goodput_per_s={},
        passes={},
        deadline_hit=False,
        audio_s_mean=nan,
    )


class Oracle:
    """Published passes below ``published``, real-time below ``realtime`` (underruns from
    there on), interactive below ``interactive`` (p99 TTFB 600 ms from there on); RTF
    reaches 1 at ``published`` (mean TTFB 1.2 s from there on too)."""

    def __init__(self, published: int, realtime: int, interactive: int) -> None:
        self.published, self.realtime, self.interactive = published, realtime, interactive
        self.calls: list[int] = []

    def level(self, c: int) -> LevelResult:
        over_pub = c >= self.published
        return level(
            c,
            mean=1.2 if over_pub else 0.2,
            p99=1.5 if over_pub else (0.6 if c >= self.interactive else 0.3),
            rtf=1.1 if over_pub else 0.8,
            underruns=3 if c >= self.realtime else 0,
        )

    async def __call__(self, c: int) -> LevelResult:
        self.calls.append(c)
        return self.level(c)


# ------------------------------------------------------------------------------- criteria


def test_each_criterion_reads_its_own_targets() -> None:
    pub, rt, inter = all_criteria(SLO)
    # mean TTFB under 1 s but p99 over: published only
    lv = level(8, mean=0.4, p99=1.3)
    assert [passes(lv, c) for c in (pub, rt, inter)] == [True, False, False]
    assert failed_targets(lv, rt) == ["p99 TTFB 1300 ms >= 1000 ms"]
    # underruns: real-time and interactive fail, published does not look at them
    lv = level(8, underruns=2)
    assert [passes(lv, c) for c in (pub, rt, inter)] == [True, False, False]
    assert failed_targets(lv, inter) == ["2 underruns in 2 streams"]
    # p99 TTFB between 500 ms and 1 s: interactive only fails
    lv = level(8, p99=0.7)
    assert [passes(lv, c) for c in (pub, rt, inter)] == [True, True, False]
    # p99 RTF at 1 fails all three
    lv = level(8, rtf=1.0)
    assert not any(passes(lv, c) for c in (pub, rt, inter))
    assert "p99 RTF 1.00 >= 1" in failed_targets(lv, pub)
    # mean TTFB over 1 s fails published
    assert failed_targets(level(8, mean=1.1, p99=0.9), pub) == ["mean TTFB 1100 ms >= 1000 ms"]


def test_a_level_where_no_request_finished_fails_all_three() -> None:
    for lv in (level(64, requests=0), level(64, requests=5, ok=0)):
        for c in all_criteria(SLO):
            assert not passes(lv, c)
            assert failed_targets(lv, c)[0].startswith("no request finished (")


def test_unknown_criterion_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown criterion 'fast'"):
        criterion("fast", SLO)  # type: ignore[arg-type]


levels_st = st.builds(
    level,
    st.integers(1, 512),
    mean=st.floats(0.0, 2.0),
    p99=st.floats(0.0, 2.0),
    rtf=st.floats(0.0, 2.0),
    underruns=st.integers(0, 3),
    requests=st.integers(0, 20),
    ok=st.none() | st.integers(0, 20),
)


@given(levels_st)
def test_interactive_implies_real_time_and_failures_have_reasons(lv: LevelResult) -> None:
    pub, rt, inter = all_criteria(SLO)
    if passes(lv, inter):
        assert passes(lv, rt)
    if lv.ok == 0 or lv.ok < lv.requests:
        assert not any(passes(lv, c) for c in (pub, rt, inter))
    for c in (pub, rt, inter):
        assert passes(lv, c) == (failed_targets(lv, c) == [])


@given(st.lists(levels_st, max_size=12))
def test_capacity_is_the_largest_measured_passing_level(levels: list[LevelResult]) -> None:
    by_c = {lv.concurrency: lv for lv in levels}
    for cap in capacities_of(levels, SLO):
        crit = criterion(cap.criterion, SLO)
        passing = {c for c, lv in by_c.items() if passes(lv, crit)}
        assert cap.concurrency == max(passing, default=0)  # never an interpolation
        failing = {c for c in by_c if c not in passing}
        above = {c for c in failing if c > cap.concurrency}
        assert cap.first_failure == min(above, default=None)
        assert cap.at_least == (cap.first_failure is None)
        assert cap.failing_below == sorted(c for c in failing if c < cap.concurrency)
        if cap.first_failure is not None:
            assert cap.bounded_by == failed_targets(by_c[cap.first_failure], crit)


def test_capacity_names_a_failure_below_it() -> None:
    levels = [level(32), level(48, underruns=1), level(64), level(96, rtf=1.2)]
    rt = capacity_of(levels, criterion("real-time", SLO))
    assert (rt.concurrency, rt.first_failure, rt.failing_below) == (64, 96, [48])


# ------------------------------------------------------------------------------- search


async def test_search_brackets_each_criterion_and_reuses_levels() -> None:
    oracle = Oracle(published=150, realtime=100, interactive=60)
    result = await CapacitySearch(oracle, SLO, resolution=0.0).run(start=8, maximum=1024)
    pub, rt, inter = result.capacities
    assert [c.criterion for c in result.capacities] == list(CRITERIA)
    assert (pub.concurrency, pub.first_failure) == (149, 150)
    assert "p99 RTF 1.10 >= 1" in pub.bounded_by
    assert (rt.concurrency, rt.first_failure) == (99, 100)
    assert rt.bounded_by == ["3 underruns in 3 streams"]
    assert (inter.concurrency, inter.first_failure) == (59, 60)
    assert inter.bounded_by == ["p99 TTFB 600 ms >= 500 ms"]
    assert len(oracle.calls) == len(set(oracle.calls))  # no level is run twice
    assert result.probes == oracle.calls
    assert oracle.calls[:5] == [8, 16, 32, 64, 128]  # real-time first: doubling from 8


async def test_coarse_resolution_stops_early() -> None:
    oracle = Oracle(published=10_000, realtime=100, interactive=10_000)
    search = CapacitySearch(oracle, SLO, resolution=0.1)
    cap = await search.find("real-time", start=8, maximum=1024)
    # 64 passes, 128 fails; 96 passes, 112 fails, 104 fails: 104 - 96 <= 9.6
    assert (cap.concurrency, cap.first_failure) == (96, 104)
    assert oracle.calls == [8, 16, 32, 64, 128, 96, 112, 104]


async def test_search_from_above_halves_down() -> None:
    oracle = Oracle(published=10, realtime=10, interactive=10)
    cap = await CapacitySearch(oracle, SLO, resolution=0.0).find("real-time", 64, 1024)
    assert (cap.concurrency, cap.first_failure) == (9, 10)
    assert oracle.calls[:4] == [64, 32, 16, 8]


async def test_nothing_passes_is_capacity_zero() -> None:
    oracle = Oracle(published=1, realtime=1, interactive=1)
    result = await CapacitySearch(oracle, SLO).run(start=4, maximum=64)
    assert [c.concurrency for c in result.capacities] == [0, 0, 0]
    assert all(c.first_failure == 1 and not c.at_least for c in result.capacities)
    assert oracle.calls == [4, 2, 1]


async def test_everything_passes_up_to_the_maximum() -> None:
    oracle = Oracle(published=10_000, realtime=10_000, interactive=10_000)
    result = await CapacitySearch(oracle, SLO).run(start=8, maximum=40)
    assert all(c.at_least and c.concurrency == 40 for c in result.capacities)
    assert oracle.calls == [8, 16, 32, 40]


async def test_a_stalled_first_level_is_a_failure_under_all_three() -> None:
    """The start-up stall of the first H100 searches: nothing finished at the start level.
    No capacity counts it as a pass, and the search cannot tell it from a limit: it bounds
    every criterion (why the search runs a warm-up level first, bench.load.cli)."""

    class Stalled(Oracle):
        def level(self, c: int) -> LevelResult:
            return level(c, requests=0) if c == 64 else super().level(c)

    oracle = Stalled(published=10_000, realtime=80, interactive=10_000)
    result = await CapacitySearch(oracle, SLO, resolution=0.0).run(start=64, maximum=1024)
    for cap in result.capacities:
        assert (cap.concurrency, cap.first_failure) == (63, 64)
        assert cap.bounded_by == ["no request finished (no measured request)"]


@settings(max_examples=60, deadline=None)
@given(
    published=st.integers(1, 600),
    realtime=st.integers(1, 600),
    interactive=st.integers(1, 600),
    start=st.integers(1, 700),
    maximum=st.integers(1, 700),
    resolution=st.sampled_from([0.0, 0.05, 0.1, 0.25]),
)
async def test_search_invariants(
    published: int, realtime: int, interactive: int, start: int, maximum: int, resolution: float
) -> None:
    # real-time never looser than published in this oracle, interactive never looser than
    # real-time: as on a real server (RTF and TTFB grow with load)
    realtime, interactive = min(realtime, published), min(interactive, realtime, published)
    oracle = Oracle(published, realtime, interactive)
    result = await CapacitySearch(oracle, SLO, resolution=resolution).run(start, maximum)
    assert len(oracle.calls) == len(set(oracle.calls)) and result.probes == oracle.calls
    assert all(1 <= c <= max(maximum, 1) for c in oracle.calls)
    for cap, bound in zip(result.capacities, (published, realtime, interactive), strict=True):
        crit = criterion(cap.criterion, SLO)
        if cap.concurrency:
            assert passes(oracle.level(cap.concurrency), crit)
            assert cap.concurrency < bound  # only passing levels count
        if cap.at_least:
            assert cap.concurrency == min(maximum, bound - 1)  # stopped at the maximum
            assert cap.concurrency == maximum
        else:
            hi = cap.first_failure
            assert hi is not None and not passes(oracle.level(hi), crit)
            assert hi - cap.concurrency <= max(1, math.floor(cap.concurrency * resolution))


# ------------------------------------------------------------------------------- recompute


def test_recomputed_h100_result_states_the_three_capacities(tmp_path: Path) -> None:
    """docs/results/h100_capacity_v2.json, as committed (recomputed from its levels)."""
    report, data = recompute(RESULTS / "h100_capacity_v2.json")
    pub, rt, inter = report.capacities
    assert (pub.concurrency, pub.at_least, pub.first_failure) == (96, True, None)
    assert max(lv.concurrency or 0 for lv in report.levels) == 96  # the largest level probed
    assert (rt.concurrency, rt.first_failure) == (78, 84)
    assert rt.bounded_by == ["5 underruns in 3 streams"]
    assert (inter.concurrency, inter.first_failure) == (78, 84)
    assert data["capacities"][1]["concurrency"] == 78
    assert data["search"]["probes"] == [96, 48, 72, 84, 78]
    # recomputing what was recomputed changes no figure
    again = tmp_path / "again.json"
    again.write_bytes(msgspec.json.encode(data))
    _, data2 = recompute(again)
    assert data2["capacities"] == data["capacities"]
    assert data2["search_before_recompute"] == data["search_before_recompute"]
