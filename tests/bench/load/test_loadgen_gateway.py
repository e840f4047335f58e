"""The load generator against the real gateway, over HTTP and over ZeroMQ.

The gateway is orpheus-serve's own (``gateway_harness``); a synthetic backend stands in
for the llm and codec workers and writes the real PCM ring at real-time pace. This checks
the two client transports end to end; the e2e run against vLLM is in
compare/test_compare_baseline.py."""

from __future__ import annotations

import pytest
from gateway_harness import running_gateway

from bench.load.runner import LevelPlan, run_closed
from bench.load.session import Target
from bench.load.summary import Slo, summarize
from bench.load.texts import load_corpus
from bench.load.trace import Outcome
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
