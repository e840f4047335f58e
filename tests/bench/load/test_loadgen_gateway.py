"""The load generator against the real gateway, over HTTP and over ZeroMQ.

The gateway is orpheus-serve's own (``gateway_harness``); a synthetic backend stands in
for the llm and codec workers and writes the real PCM ring at real-time pace. This checks
the two client transports end to end; the e2e run against vLLM is in
compare/test_compare_baseline.py."""

from __future__ import annotations

import pytest
from gateway_harness import running_gateway, wait_until

from bench.load.clients import SpeechRequest
from bench.load.runner import LevelPlan, run_closed
from bench.load.session import Target
from bench.load.summary import Slo, summarize
from bench.load.texts import load_corpus
from bench.load.trace import Outcome, StreamTrace
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)

FRAMES = 6


@pytest.mark.parametrize("transport", ["http", "zmq"])
async def test_closed_loop_through_the_gateway(layout: InstanceLayout, transport: str) -> None:
    async with running_gateway(layout, zmq=True, backend={"realtime": True}) as h:
        zmq = h.config.gateway.zmq_endpoint if transport == "zmq" else None
        client = Target(url=h.url, zmq=zmq, read_timeout_s=20).client()
        plan = LevelPlan(duration_s=20, warmup_s=0, max_requests=4, fixed_tokens=7 * FRAMES)
        try:
            run = await run_closed(client, 3, plan, load_corpus())
        finally:
            await client.aclose()
        submitted = h.backend.submitted()
    measured = [t for t in run.traces if t.measured]
    assert len(measured) == 4
    assert all(t.outcome is Outcome.OK for t in measured), [t.error for t in measured]
    # orpheus-serve emits every frame of the utterance
    assert all(t.audio_bytes == FRAMES * 2048 * 2 for t in measured)
    assert all(s.sampling.max_tokens == 7 * FRAMES and s.voice == "tara" for s in submitted)
    result = summarize(run, Slo())
    assert result.ok == 4 and result.audio_s_per_s > 0


@pytest.mark.parametrize("transport", ["http", "zmq"])
async def test_the_load_generator_measures_synthesis_unless_told_to_use_the_cache(
    layout: InstanceLayout, transport: str
) -> None:
    """The corpus's texts repeat within a level, and the sentence audio cache is on by
    default: every request says no-store (a repeat is synthesised again); ``use_cache``
    (``--use-cache``) lets the cache store the second saying and answer the third."""
    request = SpeechRequest(text="Thank you for calling.", max_tokens=7 * FRAMES)

    async def say(target: Target, times: int) -> None:
        client = target.client()
        try:
            for i in range(times):
                trace = StreamTrace(index=i, kind="short", chars=22, scheduled=0.0)
                await client.stream(request, trace)
                assert trace.outcome is Outcome.OK and trace.audio_bytes == FRAMES * 2048 * 2
        finally:
            await client.aclose()

    async with running_gateway(layout, zmq=True) as h:
        zmq = h.config.gateway.zmq_endpoint if transport == "zmq" else None
        await say(Target(url=h.url, zmq=zmq, read_timeout_s=20), 3)
        assert len(h.backend.submitted()) == 3
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "bypass"}) == 3
        await say(Target(url=h.url, zmq=zmq, read_timeout_s=20, use_cache=True), 2)
        await wait_until(lambda: h.metric("orpheus_gateway_cache_stores_total") == 1)
        await say(Target(url=h.url, zmq=zmq, read_timeout_s=20, use_cache=True), 1)
        assert len(h.backend.submitted()) == 5  # the third saying was the cache's
        assert h.metric("orpheus_gateway_cache_lookups_total", {"result": "hit"}) == 1
