"""The load loops against real HTTP test servers on loopback.

The servers here are the other end of the wire, not the product: they answer the
/v1/audio/speech pcm contract with silence at controlled moments, so that the
generator's own behaviour (open-loop arrivals, TTFB from the scheduled time, closed-loop
concurrency, ramp-down fillers, deadlines) can be checked without an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from bench.load.clients import HttpSpeechClient
from bench.load.runner import LevelPlan, run_closed, run_open
from bench.load.schedule import poisson_schedule
from bench.load.texts import load_corpus
from bench.load.trace import Outcome, StreamTrace, stream_metrics

pytestmark = pytest.mark.timeout(60)

CHUNK = b"\x00\x00" * 2048  # one SNAC frame of silence


class SpeechServer:
    """Counts requests and in-flight streams around a pluggable streaming behaviour."""

    def __init__(self, behaviour: Callable[[web.StreamResponse, int], Awaitable[None]]) -> None:
        self.behaviour = behaviour
        self.received: list[float] = []
        self.bodies: list[dict[str, object]] = []
        self.active = 0
        self.max_active = 0

    async def speech(self, request: web.Request) -> web.StreamResponse:
        self.received.append(time.perf_counter())
        self.bodies.append(await request.json())
        index = len(self.received) - 1
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "audio/pcm"})
            await resp.prepare(request)
            await self.behaviour(resp, index)
            await resp.write_eof()
            return resp
        finally:
            self.active -= 1


@contextlib.asynccontextmanager
async def serve(server: SpeechServer) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/audio/speech", server.speech)
    ts = TestServer(app, host="127.0.0.1")
    await ts.start_server()
    try:
        yield str(ts.make_url("")).rstrip("/")
    finally:
        await ts.close()


async def test_open_loop_arrivals_do_not_wait_for_a_stalled_server() -> None:
    rate, duration, seed = 25.0, 0.8, 3
    plan = LevelPlan(duration_s=duration, warmup_s=0.0, drain_timeout_s=20.0, seed=seed)
    offsets = poisson_schedule(rate, plan.duration_s + plan.drain_timeout_s, seed)
    n_measured = sum(1 for o in offsets if o < duration)
    assert n_measured >= 5
    release = asyncio.Event()
    released_at: list[float] = []

    async def stall_until_all_arrived(resp: web.StreamResponse, index: int) -> None:
        if index + 1 >= n_measured and not release.is_set():
            released_at.append(time.perf_counter())
            release.set()
        await asyncio.wait_for(release.wait(), 15)
        await resp.write(CHUNK)

    server = SpeechServer(stall_until_all_arrived)
    async with serve(server) as url:
        client = HttpSpeechClient(url, read_timeout_s=30, api_key=None)
        try:
            run = await run_open(client, rate, plan, load_corpus())
        finally:
            await client.aclose()
    # Every measured request reached the server while all earlier ones were still stalled:
    # no answer was sent before the last of them arrived.
    assert len(released_at) == 1
    measured = [t for t in run.traces if t.measured]
    assert len(measured) == n_measured
    assert all(t.outcome is Outcome.OK for t in measured)
    for t, offset in zip(run.traces, offsets, strict=False):
        assert t.scheduled == pytest.approx(run.started + offset)
        assert t.sent is not None and t.sent >= t.scheduled
    # The stall counts in TTFB: first audio came after the release, measured from the slot.
    for t in measured:
        m = stream_metrics(t, jitter_buffer_s=0.1)
        assert m.ttfb_s is not None and m.ttfb_s >= released_at[0] - t.scheduled
    assert not run.deadline_hit


async def test_ttfb_counts_the_time_the_generator_fell_behind() -> None:
    async def instant(resp: web.StreamResponse, index: int) -> None:
        await resp.write(CHUNK)

    blocked = 0.3
    first = True

    def busy_generator(trace: StreamTrace) -> None:
        nonlocal first
        if first:  # the generator's own loop is stuck (GC pause, overloaded client host)
            first = False
            time.sleep(blocked)

    plan = LevelPlan(duration_s=0.5, warmup_s=0.0, drain_timeout_s=10.0, max_requests=3, seed=1)
    async with serve(SpeechServer(instant)) as url:
        client = HttpSpeechClient(url, read_timeout_s=30, api_key=None)
        try:
            run = await run_open(client, 20.0, plan, load_corpus(), on_issue=busy_generator)
        finally:
            await client.aclose()
    head = run.traces[0]
    m = stream_metrics(head, jitter_buffer_s=0.1)
    assert head.sent is not None and head.first_byte is not None
    assert m.send_lag_s is not None and m.send_lag_s >= blocked
    assert m.ttfb_s is not None and m.ttfb_s >= blocked
    # Measured from the actual send it would have looked fast; it must not.
    assert m.ttfb_s - (head.first_byte - head.sent) >= blocked


async def test_closed_loop_holds_concurrency_and_trims_warmup_and_rampdown() -> None:
    async def three_frames(resp: web.StreamResponse, index: int) -> None:
        for _ in range(3):
            await asyncio.sleep(0.02)
            await resp.write(CHUNK)

    concurrency = 4
    plan = LevelPlan(
        duration_s=30.0, warmup_s=0.0, max_requests=6, drain_timeout_s=20.0, fixed_tokens=70
    )
    server = SpeechServer(three_frames)
    async with serve(server) as url:
        client = HttpSpeechClient(url, read_timeout_s=30, api_key=None)
        try:
            run = await run_closed(client, concurrency, plan, load_corpus())
        finally:
            await client.aclose()
        for _ in range(100):  # cancelled fillers disconnect; the server sees them go
            if server.active == 0:
                break
            await asyncio.sleep(0.02)
        assert server.active == 0
    assert server.max_active == concurrency
    assert [t.measured for t in run.traces[:concurrency]] == [False] * concurrency
    measured = [t for t in run.traces if t.measured]
    assert len(measured) == 6
    assert all(t.outcome is Outcome.OK and t.audio_bytes == 3 * len(CHUNK) for t in measured)
    last_measured = max(t.index for t in measured)
    fillers = run.traces[last_measured + 1 :]
    assert all(not t.measured for t in fillers)
    assert all(t.outcome in (Outcome.OK, Outcome.CANCELLED) for t in fillers)
    assert all(body["max_tokens"] == 70 for body in server.bodies)
    assert all(body["response_format"] == "pcm" for body in server.bodies)
    assert run.finished - run.started < plan.duration_s  # ended by the budget, not the clock


async def test_measured_requests_still_running_at_the_deadline_are_timeouts() -> None:
    async def never(resp: web.StreamResponse, index: int) -> None:
        await asyncio.sleep(3600)

    plan = LevelPlan(duration_s=0.3, warmup_s=0.0, drain_timeout_s=0.3, seed=2)
    async with serve(SpeechServer(never)) as url:
        client = HttpSpeechClient(url, read_timeout_s=30, api_key=None)
        try:
            run = await run_open(client, 20.0, plan, load_corpus())
        finally:
            await client.aclose()
    assert run.deadline_hit
    measured = [t for t in run.traces if t.measured]
    assert measured and all(t.outcome is Outcome.TIMEOUT for t in measured)


async def test_server_errors_are_recorded_not_raised() -> None:
    async def overloaded(request: web.Request) -> web.Response:
        return web.json_response(
            {"error": {"message": "busy", "type": "overloaded", "code": "busy"}},
            status=503,
            headers={"Retry-After": "1"},
        )

    app = web.Application()
    app.router.add_post("/v1/audio/speech", overloaded)
    ts = TestServer(app, host="127.0.0.1")
    await ts.start_server()
    plan = LevelPlan(duration_s=10.0, warmup_s=0.0, max_requests=2, retry_backoff_s=0.01)
    client = HttpSpeechClient(str(ts.make_url("")), read_timeout_s=30, api_key=None)
    try:
        run = await run_closed(client, 1, plan, load_corpus())
    finally:
        await client.aclose()
        await ts.close()
    measured = [t for t in run.traces if t.measured]
    assert len(measured) == 2
    assert all(t.outcome is Outcome.HTTP_ERROR and t.status == 503 for t in measured)
    assert "busy" in measured[0].error
