"""One owner of a stream's life in the llm workers (``gateway.upstream.Upstream``): its
submit, its appends and its cancel, each sent once, to its engine.

The gateway's own parts, wired as ``Gateway`` wires them (``RequestTracker``, the
``StreamRegistry`` told each stream that leaves, ``Upstream`` on real ZeroMQ PUSH sockets):
what reaches the engines' control sockets is read back and decoded. Each path where the
cancel used to come from the stream registry and the submit from the request is driven as
the front ends and the PCM pump drive it: the client going away, the stream failing (a
sequence gap, a slow client, the watchdog, a worker restart) and the request leaving after
it, a worker's ERROR, a normal end, a request spoken in runs (break tags).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator, Iterator

import pytest
import zmq
from prometheus_client import CollectorRegistry

from common.config.gateway import GatewayConfig
from common.limits import RequestLimits
from gateway.admission.queue import Admission
from gateway.apis import Api
from gateway.frontends.openai.body import decode_speech_request, speech_params
from gateway.link import ClientLink, ClientLinks
from gateway.metrics import GatewayMetrics
from gateway.requests import ActiveRequest, RequestTracker
from gateway.schemas import SpeechParams
from gateway.streams import StreamFailed, StreamRegistry
from gateway.upstream import Upstream
from gateway.voices.catalogue import ENGLISH_VOICES, VoiceCatalog
from shm.messages import LlmAppendText, LlmCancel, LlmControl, LlmSubmit, llm_control_decoder
from shm.records import RecordKind, StreamEnd, StreamError, record_encoder
from shm.ring import Record

pytestmark = pytest.mark.timeout(30)

ENGINES = 2
QUIET_S = 0.1
"""A control socket that received nothing for this long has everything that was sent."""
VOICES = VoiceCatalog({}, list(ENGLISH_VOICES), "tara")
_names = itertools.count()


def _params(text: str = "Hello there.") -> SpeechParams:
    body = {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm"}
    return speech_params(
        decode_speech_request(json.dumps(body).encode()), VOICES, RequestLimits(), 4096
    )


class Engines:
    """The engines' control sockets (PULL, as each llm worker binds its own)."""

    def __init__(self, ctx: zmq.Context) -> None:
        n = next(_names)
        self.endpoints = [f"inproc://test-control-{n}-{e}" for e in range(ENGINES)]
        self.socks = []
        for ep in self.endpoints:
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ep)
            self.socks.append(sock)

    def received(self) -> list[tuple[int, LlmControl]]:
        """(engine, message) of everything sent since the last call."""
        got: list[tuple[int, LlmControl]] = []
        poller = zmq.Poller()
        for sock in self.socks:
            poller.register(sock, zmq.POLLIN)
        while ready := poller.poll(QUIET_S * 1000):
            for sock, _ in ready:
                got.append(
                    (self.socks.index(sock), llm_control_decoder.decode(sock.recv(zmq.NOBLOCK)))
                )
        return got

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)


class GatewayParts:
    """The parts of one gateway process that a request's upstream life goes through."""

    def __init__(self, ctx: zmq.Context, *, max_buffered_bytes: int = 1 << 20) -> None:
        self.engines = Engines(ctx)
        self.metrics = GatewayMetrics(CollectorRegistry())
        self.upstream = Upstream(self.engines.endpoints, ctx)
        self.registry = StreamRegistry(
            0, self.upstream.stream_left, self.metrics, max_buffered_bytes=max_buffered_bytes
        )
        self.admission = Admission(
            max_active=8, max_queued=0, queue_timeout_s=1, retry_after_s=1, gate=lambda: None,
            engines=ENGINES,
        )  # fmt: skip
        self.requests = RequestTracker(
            GatewayConfig(), self.admission, self.registry, self.upstream, self.metrics
        )
        self.links = ClientLinks(self.metrics)
        loop = asyncio.get_running_loop()
        self.requests.start(loop)
        self.links.start(loop)
        self.aborted = 0

    def link(self) -> ClientLink:
        return ClientLink(self.links, Api.OPENAI_HTTP, self._abort)

    def _abort(self) -> None:
        self.aborted += 1

    def pcm(self, request: ActiveRequest, seq: int, n: int = 480) -> None:
        """A PCM record of the request's stream, as the pump hands it over."""
        record = Record(RecordKind.PCM, request.stream.stream_id, seq, memoryview(bytes(n)))
        self.registry.dispatch([record], asyncio.get_running_loop().time())

    def end(self, request: ActiveRequest, seq: int, frames: int = 1) -> None:
        payload = record_encoder.encode(StreamEnd("stop", frames, frames * 7))
        record = Record(RecordKind.END, request.stream.stream_id, seq, memoryview(payload))
        self.registry.dispatch([record], asyncio.get_running_loop().time())

    def error(self, request: ActiveRequest, error: StreamError) -> None:
        payload = record_encoder.encode(error)
        record = Record(RecordKind.ERROR, request.stream.stream_id, 0, memoryview(payload))
        self.registry.dispatch([record], asyncio.get_running_loop().time())

    def close(self) -> None:
        self.upstream.close()
        self.engines.close()
        self.admission.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    yield ctx
    ctx.term()


@pytest.fixture
async def gw(ctx: zmq.Context) -> AsyncIterator[GatewayParts]:
    g = GatewayParts(ctx)
    yield g
    g.close()


def _cancels(got: list[tuple[int, LlmControl]]) -> list[tuple[int, int, str]]:
    """(engine, stream id, reason) of each cancel sent."""
    return [(e, m.stream_id, m.reason) for e, m in got if isinstance(m, LlmCancel)]


def _submits(got: list[tuple[int, LlmControl]]) -> list[tuple[int, int]]:
    return [(e, m.stream_id) for e, m in got if isinstance(m, LlmSubmit)]


async def _drain(request: ActiveRequest) -> int:
    """Read the request's stream as a front end does, up to its end; the bytes read."""
    n = 0
    while chunks := await request.stream.next_chunks():
        n += sum(len(c) for c in chunks)
    return n


async def test_a_normal_end_sends_no_cancel(gw: GatewayParts) -> None:
    async with gw.requests.open(_params(), gw.link()) as request:
        sid, engine = request.stream.stream_id, request.stream.engine
        gw.pcm(request, 0)
        gw.end(request, 1)
        assert await _drain(request) == 480
        request.complete()
    got = gw.engines.received()
    assert _submits(got) == [(engine, sid)] and _cancels(got) == []
    assert len(gw.upstream) == 0 and len(gw.registry) == 0


async def test_a_client_that_goes_away_cancels_once_on_the_streams_engine(gw: GatewayParts) -> None:
    # Two requests, placed on the two engines; the second client leaves mid-stream.
    async with gw.requests.open(_params(), gw.link()) as first:
        with pytest.raises(ConnectionResetError):
            async with gw.requests.open(_params(), gw.link()) as request:
                assert {first.stream.engine, request.stream.engine} == {0, 1}
                gw.pcm(request, 0)
                await request.stream.next_chunks()
                raise ConnectionResetError  # the front end's write to the gone client
        gw.end(first, 0, frames=0)
        assert await _drain(first) == 0
        first.complete()
    got = gw.engines.received()
    assert _cancels(got) == [
        (request.stream.engine, request.stream.stream_id, "client_disconnected")
    ]
    assert len(_submits(got)) == 2 and len(gw.upstream) == 0
    assert gw.metrics.registry.get_sample_value(
        "orpheus_gateway_requests_total", {"api": "http", "outcome": "cancelled"}
    ) == 1  # fmt: skip


@pytest.mark.parametrize("how", ["sequence_gap", "slow_client", "watchdog", "worker_restarted"])
async def test_a_failing_stream_cancels_once_and_leaving_after_it_sends_no_other(
    ctx: zmq.Context, how: str
) -> None:
    """The registry fails the stream (the cancel); the front end reads the failure and its
    request leaves (the cancel that the release used to send: none)."""
    gw = GatewayParts(ctx, max_buffered_bytes=1000)
    try:
        async with (
            gw.requests.open(_params(), gw.link()) as request,
            gw.requests.open(_params(), gw.link()) as other,
        ):
            gw.pcm(request, 0)
            if how == "sequence_gap":
                gw.pcm(request, 2)
                code = "pcm_sequence_error"
            elif how == "slow_client":
                gw.pcm(request, 1, 600)  # past the 1000 bytes a client may leave unread
                code = "slow_client"
            elif how == "watchdog":
                now = asyncio.get_running_loop().time()
                error = StreamError("upstream_timeout", "silent", 504)
                gw.requests.sweep(
                    now + 60, idle_s=30, text_idle_s=120, upstream_timeout=error,
                    text_timeout=error,
                )  # fmt: skip
                code = "upstream_timeout"
            else:
                engines = frozenset({request.stream.engine})
                gw.registry.fail_all(StreamError("worker_restarted", "gone", 503), engines=engines)
                code = "worker_restarted"
            with pytest.raises(StreamFailed) as e:
                await _drain(request)
            assert e.value.error.code == code
            if how != "watchdog":  # (the sweep times out both: neither spoke)
                gw.pcm(other, 0)  # the failing stream stalls no other
                gw.end(other, 1)
                assert await _drain(other) == 480
                other.complete()
        got = gw.engines.received()
        sid, engine = request.stream.stream_id, request.stream.engine
        assert [c for c in _cancels(got) if c[1] == sid] == [(engine, sid, code)]
        assert len(_cancels(got)) == (2 if how == "watchdog" else 1)
        assert len(gw.upstream) == 0
    finally:
        gw.close()


async def test_a_workers_error_sends_no_cancel(gw: GatewayParts) -> None:
    with pytest.raises(StreamFailed):
        async with gw.requests.open(_params(), gw.link()) as request:
            gw.error(request, StreamError("bad_request", "no such voice", 400))
            await _drain(request)
    assert _cancels(gw.engines.received()) == [] and len(gw.upstream) == 0


async def test_a_request_in_runs_cancels_only_the_run_in_the_workers(gw: GatewayParts) -> None:
    """Break tags: one stream id per run, each submitted when the one before ended; a client
    that leaves during the second run cancels that run, once, and never the first."""
    with pytest.raises(ConnectionResetError):
        async with gw.requests.open(
            _params('Hello there. <break time="100ms"/> How are you?'), gw.link()
        ) as request:
            first = request.stream.stream_id
            gw.pcm(request, 0)
            gw.end(request, 1)  # the first run ends: its silence, then the second run
            second = request.stream.stream_id
            assert second != first
            assert await request.stream.next_chunks()
            raise ConnectionResetError
    got = gw.engines.received()
    engine = request.stream.engine
    assert _submits(got) == [(engine, first), (engine, second)]
    assert _cancels(got) == [(engine, second, "client_disconnected")]
    assert len(gw.upstream) == 0


async def test_open_text_appends_go_to_the_streams_engine_and_a_timeout_cancels_once(
    gw: GatewayParts,
) -> None:
    """ZeroMQ's open text: every append goes to the stream's engine through the one owner;
    the watchdog's text timeout cancels it once, and the request leaving sends no other."""
    async with gw.requests.open(_params("Hello"), gw.link(), text_open=True) as request:
        sid, engine = request.stream.stream_id, request.stream.engine
        request.append_text(" there.", final=False)
        now = asyncio.get_running_loop().time()
        timeout = StreamError("timeout", "no text", 408)
        gw.requests.sweep(
            now + 300, idle_s=30, text_idle_s=120, upstream_timeout=timeout, text_timeout=timeout
        )
        with pytest.raises(StreamFailed):
            await _drain(request)
    got = gw.engines.received()
    assert [(e, type(m)) for e, m in got] == [
        (engine, LlmSubmit), (engine, LlmAppendText), (engine, LlmCancel),
    ]  # fmt: skip
    assert _cancels(got) == [(engine, sid, "timeout")] and len(gw.upstream) == 0
