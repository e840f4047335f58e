"""bench/cache/policy.py: the policies' choice on the voice-agent trace, small enough for a
test: no policy hits more than the trace repeats; after a flood of one-off sentences, LRU
has lost the stock phrases that second sight and TinyLFU kept (the measurement behind the
node cache's rule, docs/performance.md)."""

from __future__ import annotations

from bench.cache.policy import (
    BYTES_PER_CHAR,
    STOCK,
    Lru,
    SecondSight,
    TinyLfu,
    simulate,
    voice_agent_trace,
)


def test_second_sight_keeps_the_stock_phrases_through_a_flood() -> None:
    trace = list(voice_agent_trace(2000, seed=3))
    capacity = sum(int(len(p) * BYTES_PER_CHAR) for p in STOCK)  # 1x the stock phrases
    lru, second, tiny = (simulate(cls(capacity), trace) for cls in (Lru, SecondSight, TinyLfu))
    for r in (lru, second, tiny):
        assert r["hit_ratio"] <= r["repeated_ratio"]
    assert second["hit_ratio_after_flood"] > lru["hit_ratio_after_flood"] + 0.05
    assert tiny["hit_ratio_after_flood"] > lru["hit_ratio_after_flood"] + 0.05
    assert second["hit_ratio"] > lru["hit_ratio"]


def test_the_trace_is_a_third_stock_phrases_outside_its_flood() -> None:
    trace = list(voice_agent_trace(600, seed=1, flood=0))
    stock = sum(1 for text, _, _ in trace if text in STOCK)
    assert stock * 3 == len(trace)
