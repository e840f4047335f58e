"""``bench cache --scenario seam`` (bench/cache/seam.py): the seam found in a stream by the
greeting's byte count, and the scenario's two arms against the real gateway with a
synthetic backend (``gateway_harness``: PCM as fast as the ring takes it, no engine). No timing is asserted:
numbers from a shared machine are a report, not a test."""

from __future__ import annotations

import pytest
from gateway_harness import running_gateway

from bench.cache.seam import JITTER_S, run_phase, seam, sentence, summarise, warm
from bench.cache.trace import FIVE, KEY
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)


def test_the_seam_is_where_the_greetings_bytes_end() -> None:
    # 96,000 B of greeting (2 s) at once in two reads, the rest 0.5 s later.
    times, sizes = [1.0, 1.01, 1.51, 1.6], [48_000, 48_000, 4_000, 4_000]
    gap, margin = seam(times, sizes, 96_000, times[0])
    assert gap == pytest.approx(0.5)
    assert margin == pytest.approx(1.0 + JITTER_S + 2.0 - 1.51)
    # One read held the seam: no gap; a stream that ends with the greeting has no seam.
    assert seam([1.0], [100_000], 96_000, 1.0)[0] == 0.0
    assert seam([1.0, 2.0], [48_000, 48_000], 96_000, 1.0) == (None, None)


async def test_a_cached_greeting_opens_a_partial_stream_and_no_store_bypasses_it(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout) as h:
        lengths = await warm(h.url, KEY, FIVE[:1])
        assert lengths[FIVE[0]] > 0
        cached = await run_phase(h.url, KEY, 1.0, False, [sentence(1)], lengths)
        bypassed = await run_phase(h.url, KEY, 1.0, True, [sentence(2)], lengths)
    assert cached and bypassed
    assert {r.x_cache for r in cached} == {"partial"}
    assert "partial" not in {r.x_cache for r in bypassed}
    for r in cached + bypassed:
        assert r.prefix_bytes == lengths[FIVE[0]] and r.audio_s * 48_000 > r.prefix_bytes
        assert r.seam_gap_s is not None and r.seam_gap_s >= 0 and r.seam_margin_s is not None
    arm = summarise(cached, 1.0)
    assert arm.requests == len(cached) and arm.x_cache == {"partial": len(cached)}
    assert arm.seam_gap_ms.n == len(cached) and arm.playable_ratio is not None
    (greeting,) = arm.by_greeting_s.values()
    assert greeting.requests == len(cached)
