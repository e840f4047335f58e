"""The bracketing capacity search, on levels whose outcome is known in advance.

Each probe summarizes synthetic traces in which TTFB is ``c`` ms x 10 and RTF is
``c / 100``: so a level passes a 1 s TTFB budget below c = 100 and a 500 ms budget
below c = 50.
"""

from __future__ import annotations

from bench.load.search import CapacitySearch, failed_targets
from bench.load.summary import LevelResult, LevelRun, Slo, summarize
from bench.load.trace import Outcome, StreamTrace

SLO = Slo(ttfb_s=1.0, ttfb_report_s=(0.5,), jitter_buffer_s=0.1)
HALF_SECOND = 24_000


def synthetic_level(concurrency: int, *, limit: float = 100.0) -> LevelResult:
    ttfb, rtf = concurrency / limit, concurrency / limit
    traces = []
    for i in range(3):
        t = StreamTrace(index=i, kind="short", chars=30, scheduled=float(i), measured=True)
        t.sent = t.scheduled
        t.record(t.scheduled + ttfb, HALF_SECOND)
        t.record(t.scheduled + rtf, HALF_SECOND)  # 1 s of audio, last byte at rtf
        t.outcome, t.status, t.done = Outcome.OK, 200, t.scheduled + rtf
        traces.append(t)
    run = LevelRun(
        mode="closed",
        concurrency=concurrency,
        started=0.0,
        measure_start=0.0,
        measure_end=9.0,
        finished=9.0,
        traces=traces,
    )
    return summarize(run, SLO)


class Oracle:
    def __init__(self, limit: float = 100.0) -> None:
        self.limit = limit
        self.calls: list[int] = []

    async def __call__(self, concurrency: int) -> LevelResult:
        self.calls.append(concurrency)
        return synthetic_level(concurrency, limit=self.limit)


async def test_exact_search_finds_both_budgets_and_reuses_probes() -> None:
    oracle = Oracle()
    search = CapacitySearch(oracle, SLO, resolution=0.0)
    result = await search.run(start=8, maximum=1024)
    main, strict = result.capacities
    assert (main.ttfb_budget_s, main.concurrency, main.first_failure) == (1.0, 99, 100)
    assert not main.at_least
    assert any(r.startswith("p99 RTF 1.00 >= 1") for r in main.bounded_by)
    assert (strict.ttfb_budget_s, strict.concurrency, strict.first_failure) == (0.5, 49, 50)
    assert any("p99 TTFB 500 ms >= 500 ms" in r for r in strict.bounded_by)
    assert len(oracle.calls) == len(set(oracle.calls))  # no level is run twice
    assert result.probes == oracle.calls
    # doubling 8..128, then bisection between 64 and 128
    assert oracle.calls[:5] == [8, 16, 32, 64, 128]


async def test_coarse_resolution_stops_early() -> None:
    oracle = Oracle()
    cap = await CapacitySearch(oracle, SLO, resolution=0.1).find(1.0, start=8, maximum=1024)
    # 64 passes, 128 fails; 96 passes, 112 fails, 104 fails: 104 - 96 <= 9.6
    assert (cap.concurrency, cap.first_failure) == (96, 104)
    assert oracle.calls == [8, 16, 32, 64, 128, 96, 112, 104]


async def test_search_from_above_halves_down() -> None:
    oracle = Oracle(limit=10.0)
    cap = await CapacitySearch(oracle, SLO, resolution=0.0).find(1.0, start=64, maximum=1024)
    assert (cap.concurrency, cap.first_failure) == (9, 10)
    assert oracle.calls[:4] == [64, 32, 16, 8]


async def test_nothing_passes_is_capacity_zero() -> None:
    oracle = Oracle(limit=0.5)  # even one stream is slower than real time
    result = await CapacitySearch(oracle, SLO).run(start=4, maximum=64)
    assert [c.concurrency for c in result.capacities] == [0, 0]
    assert result.capacities[0].first_failure == 1
    assert oracle.calls == [4, 2, 1]


async def test_everything_passes_up_to_the_maximum() -> None:
    oracle = Oracle(limit=10_000.0)
    cap = await CapacitySearch(oracle, SLO).find(1.0, start=8, maximum=40)
    assert cap.at_least and cap.concurrency == 40 and cap.first_failure is None
    assert oracle.calls == [8, 16, 32, 40]


def test_failed_targets_lists_every_miss() -> None:
    level = synthetic_level(150)
    reasons = failed_targets(level, SLO, 1.0)
    assert reasons == ["p99 RTF 1.50 >= 1", "p99 TTFB 1500 ms >= 1000 ms"]
    assert failed_targets(synthetic_level(10), SLO, 1.0) == []
