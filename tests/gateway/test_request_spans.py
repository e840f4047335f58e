"""The gateway's spans (tracing on, the SDK's in-memory exporter) against the synthetic backend:
a client's W3C ``traceparent`` (HTTP header or ZeroMQ ``Speak`` field) is continued, the
request's span holds its admission and first audio byte, and ``LlmSubmit`` carries the
request's context to the llm worker. Tracing off: no context is sent."""

from __future__ import annotations

import asyncio
import functools

import aiohttp
import pytest
from gateway_harness import NO_STORE, running_gateway
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.tracing import Tracing
from gateway.requests import QUEUED_SPAN_NS
from orpheus_client.zmq_client import Client
from shm.layout import InstanceLayout

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def memory_tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider, "gateway"), exporter


async def speak_http(url: str, headers: dict[str, str]) -> bytes:
    body = {"model": "orpheus", "input": "Hello", "voice": "tara", "response_format": "pcm"}
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/audio/speech", json=body, headers=headers) as resp:
            assert resp.status == 200
            return await resp.read()


async def test_an_http_requests_traceparent_is_continued_to_the_llm_worker(
    layout: InstanceLayout,
) -> None:
    tracing, exporter = memory_tracing()
    async with running_gateway(layout, tracing=tracing) as h:
        audio = await speak_http(h.url, {"traceparent": TRACEPARENT})
        await speak_http(h.url, {})  # no header: a trace of its own
        submits = h.backend.submitted()
    assert audio
    spans = exporter.get_finished_spans()
    requests = [s for s in spans if s.name == "tts.request"]
    assert len(requests) == 2
    for admission in (s for s in spans if s.name == "gateway.admission"):
        # A free slot costs no span; a late event loop on a loaded machine may cost one.
        assert admission.end_time - admission.start_time >= QUEUED_SPAN_NS
    first, second = requests
    assert f"{first.context.trace_id:032x}" == CLIENT_TRACE
    assert first.parent is not None and first.parent.span_id == int(CLIENT_SPAN, 16)
    assert second.parent is None and f"{second.context.trace_id:032x}" != CLIENT_TRACE
    assert 0 <= first.attributes["orpheus.queue_wait_s"] < 1
    assert first.attributes["orpheus.api"] == "http"
    assert first.attributes["orpheus.voice"] == "tara"
    assert first.attributes["orpheus.outcome"] == "ok"
    assert first.attributes["orpheus.bytes_sent"] == len(audio)
    (event,) = [e for e in first.events if e.name == "first_audio_byte"]
    assert first.start_time <= event.timestamp <= first.end_time
    # The llm worker continues the request's span, not the client's.
    assert submits[0].traceparent == f"00-{CLIENT_TRACE}-{first.context.span_id:016x}-01"
    assert submits[1].traceparent.split("-")[1] == f"{second.context.trace_id:032x}"


async def test_a_zeromq_speaks_traceparent_is_continued(layout: InstanceLayout) -> None:
    tracing, exporter = memory_tracing()
    async with running_gateway(layout, zmq=True, tracing=tracing) as h:
        endpoint = h.config.gateway.zmq_endpoint
        assert endpoint is not None

        def call() -> bytes:
            with Client(endpoint, timeout_s=10) as c:
                return b"".join(c.speech("Hello", voice="tara", traceparent=TRACEPARENT))

        assert await asyncio.to_thread(call)
        submit = h.backend.submitted()[0]
    (request,) = [s for s in exporter.get_finished_spans() if s.name == "tts.request"]
    assert request.parent is not None and request.parent.span_id == int(CLIENT_SPAN, 16)
    assert request.attributes["orpheus.api"] == "zmq"
    assert submit.traceparent == f"00-{CLIENT_TRACE}-{request.context.span_id:016x}-01"


async def test_tracing_off_sends_no_context(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h:
        await speak_http(h.url, {"traceparent": TRACEPARENT})
        assert h.backend.submitted()[0].traceparent == ""


async def test_a_queued_request_has_an_admission_span(layout: InstanceLayout) -> None:
    tracing, exporter = memory_tracing()
    async with running_gateway(
        layout,
        backend={"realtime": True},
        tracing=tracing,
        max_active_streams=1,
        max_queued_streams=1,
    ) as h:
        # no-store: the twin would otherwise follow the first's synthesis (single flight)
        held = asyncio.create_task(speak_http(h.url, {"traceparent": TRACEPARENT, **NO_STORE}))
        while not h.gateway.requests.active:
            await asyncio.sleep(0.01)
        await speak_http(h.url, NO_STORE)  # waits for the first one's slot
        await held
    spans = exporter.get_finished_spans()
    (queued,) = [s for s in spans if s.name == "tts.request" and s.parent is None]
    (admission,) = [
        s for s in spans
        if s.name == "gateway.admission" and s.parent.span_id == queued.context.span_id
    ]  # fmt: skip
    wait_s = (admission.end_time - admission.start_time) / 1e9
    assert wait_s > 0.05 and queued.attributes["orpheus.queue_wait_s"] == pytest.approx(
        wait_s, abs=0.01
    )
    assert queued.start_time <= admission.start_time <= admission.end_time <= queued.end_time
    assert admission.attributes["orpheus.engine"] == 0


async def test_a_rejected_request_ends_its_span_with_the_error(layout: InstanceLayout) -> None:
    tracing, exporter = memory_tracing()
    async with running_gateway(
        layout,
        backend={"realtime": True},
        tracing=tracing,
        max_active_streams=1,
        max_queued_streams=0,
    ) as h:
        async with aiohttp.ClientSession() as session:
            body = {"model": "orpheus", "input": "Hello " * 40, "voice": "tara"}
            post = functools.partial(
                session.post, f"{h.url}/v1/audio/speech", json=body, headers=NO_STORE
            )  # no-store: the twin would otherwise follow the first's synthesis, not queue
            first = asyncio.create_task(post())
            while not h.gateway.requests.active:
                await asyncio.sleep(0.01)
            async with post() as resp:
                assert resp.status == 429
            (await first).release()
    rejected = [
        s for s in exporter.get_finished_spans()
        if s.name == "tts.request" and s.attributes.get("orpheus.outcome") == "rejected"
    ]  # fmt: skip
    assert len(rejected) == 1 and not rejected[0].status.is_ok
