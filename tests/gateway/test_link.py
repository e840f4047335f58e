"""Every byte to a client goes through its connection's ``ClientLink`` (``gateway.link``).

Per front end, against the gateway with its synthetic backend (one 2048-sample frame per
character): the audio bytes counter equals what the client received, to the byte, and
every unit spoken has its time to first audio, also where the audio went out after its
unit ended: an encoder's tail (MP3 on ElevenLabs' WebSocket and HTTP, OpenAI, ZeroMQ), a
vLLM-Omni unit that is not streamed (one file at the end of the unit the client sees), an
ElevenLabs dialogue answered in one body. Then the link itself: a write outside any unit
is under the stall watchdog, overlapping writes keep its clock honest; and no front end
reaches the metrics.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import json
from pathlib import Path

import aiohttp
import pytest
from gateway_harness import Harness, running_gateway, wait_until
from import_contracts import contract, lint_gateway_with
from prometheus_client import CollectorRegistry

from gateway.apis import Api
from gateway.link import ClientLinks
from gateway.metrics import GatewayMetrics
from orpheus_client.zmq_client import Client
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
TWO_SENTENCES = "Hi there. Bye now."
"""Spoken as two units by the protocols that cut text into sentences."""


def bytes_sent(h: Harness, api: Api) -> float:
    return h.metric("orpheus_gateway_audio_bytes_sent_total", {"api": api.value})


def first_audio_count(h: Harness, api: Api) -> float:
    return h.metric("orpheus_gateway_ttfb_seconds_count", {"api": api.value})


async def counted(h: Harness, api: Api, received: int, units: int) -> None:
    """The counters reach what the client received (the link reports its last bytes when
    the connection's handler leaves, just after the client has them)."""
    assert received > 0
    await wait_until(
        lambda: bytes_sent(h, api) == received and first_audio_count(h, api) == units,
        what=f"{api.value}: {received} bytes and {units} first audio times counted "
        f"(counted: {bytes_sent(h, api)} and {first_audio_count(h, api)})",
    )
    await wait_until(lambda: not h.gateway.links, what="every link closed")


async def test_openai_http_mp3_counts_its_tail(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        body = {"model": "tts-1", "input": "Hello.", "voice": "tara", "response_format": "mp3"}
        async with s.post(h.url + "/v1/audio/speech", json=body) as r:
            assert r.status == 200
            audio = await r.read()
        await counted(h, Api.OPENAI_HTTP, len(audio), 1)


async def test_elevenlabs_http_mp3_counts_the_tail_after_its_last_unit(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/text-to-speech/tara/stream?output_format=mp3_44100_128"
        async with s.post(url, json={"text": TWO_SENTENCES}) as r:
            assert r.status == 200
            audio = await r.read()
        await counted(h, Api.ELEVENLABS, len(audio), 2)


async def test_elevenlabs_websocket_mp3_counts_the_context_tail(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/text-to-speech/tara/multi-stream-input?output_format=mp3_44100_128"
        audio = bytearray()
        async with s.ws_connect(url) as ws:
            await ws.send_json({"text": TWO_SENTENCES + " ", "context_id": "c"})
            await ws.send_json({"context_id": "c", "flush": True})
            await ws.send_json({"context_id": "c", "close_context": True})
            while True:
                m = json.loads((await ws.receive(20)).data)
                assert "error" not in m, m
                if m.get("isFinal"):
                    break
                if m.get("audio"):
                    audio += base64.b64decode(m["audio"])
        await counted(h, Api.ELEVENLABS, len(audio), 2)


async def test_elevenlabs_dialogue_in_one_body_counts_every_unit(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/text-to-dialogue/with-timestamps?output_format=mp3_44100_128"
        inputs = [{"text": "Hi there.", "voice_id": "tara"}, {"text": "Bye.", "voice_id": "leo"}]
        async with s.post(url, json={"inputs": inputs}) as r:
            assert r.status == 200
            body = await r.json()
        # The body carries the pause between the turns too: audio, of no unit.
        await counted(h, Api.ELEVENLABS, len(base64.b64decode(body["audio_base64"])), 2)


@pytest.mark.parametrize("stream_audio", [False, True])
async def test_omni_units_count_whether_streamed_or_not(
    layout: InstanceLayout, stream_audio: bool
) -> None:
    """Not streamed, a unit's audio is one file sent after its spoken units ended."""
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        fmt = "pcm" if stream_audio else "wav"
        audio = 0
        async with s.ws_connect(h.url + "/v1/audio/speech/stream") as ws:
            await ws.send_json({"type": "session.config", "voice": "tara",
                                "response_format": fmt, "stream_audio": stream_audio})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": TWO_SENTENCES})
            await ws.send_json({"type": "input.done"})
            while True:
                msg = await ws.receive(20)
                if msg.type == aiohttp.WSMsgType.BINARY:
                    audio += len(msg.data)
                    continue
                ev = json.loads(msg.data)
                assert ev["type"] != "error", ev
                if ev["type"] == "session.done":
                    break
            await ws.send_json({"type": "session.close"})
        await counted(h, Api.OMNI, audio, 2)


async def test_baseten_websocket_counts_every_unit(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        audio = 0
        async with s.ws_connect(h.url + "/v1/baseten/orpheus/websocket") as ws:
            await ws.send_json({"voice": "tara"})
            await ws.send_str(TWO_SENTENCES + " ")
            await ws.send_str("__END__")
            while (msg := await ws.receive(20)).type == aiohttp.WSMsgType.BINARY:
                audio += len(msg.data)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1000, msg
        await counted(h, Api.BASETEN, audio, 2)


async def test_zeromq_mp3_counts_its_tail(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True) as h:
        endpoint = h.config.gateway.zmq_endpoint
        assert endpoint is not None

        def call() -> bytes:
            with Client(endpoint, timeout_s=10) as c:
                return b"".join(c.speech("Hello", voice="tara", response_format="mp3"))

        audio = await asyncio.to_thread(call)
        await counted(h, Api.ZMQ, len(audio), 1)


# -- the link itself ---------------------------------------------------------------------------
class _Unit:
    def __init__(self) -> None:
        self.written: list[int] = []
        self.dropped: list[str] = []

    def audio_written(self, n: int) -> None:
        self.written.append(n)

    def drop(self, why: str) -> None:
        self.dropped.append(why)


def _links() -> ClientLinks:
    links = ClientLinks(GatewayMetrics(CollectorRegistry()))
    links.start(asyncio.get_running_loop())
    return links


def _drops(links: ClientLinks) -> float:
    value = links.metrics.registry.get_sample_value("orpheus_gateway_slow_client_drops_total")
    return value or 0.0


async def test_a_stalled_write_outside_any_unit_is_dropped() -> None:
    """An encoder's tail written after its unit ended is under the stall watchdog too."""
    links = _links()
    stuck: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    aborted: list[bool] = []

    def abort() -> None:
        aborted.append(True)
        stuck.set_exception(ConnectionResetError("aborted"))

    with links.open(Api.ELEVENLABS, abort) as link:
        writing = asyncio.create_task(link.write(stuck, 1000))
        await asyncio.sleep(0)
        assert link.write_started
        links.sweep(link.write_started + 1.0, stall_s=5.0)  # not yet
        assert not aborted
        links.sweep(link.write_started + 6.0, stall_s=5.0)
        assert aborted and _drops(links) == 1
        with pytest.raises(ConnectionResetError):
            await writing
        assert link.write_started == 0.0 and link.bytes_sent == 0  # never written
    assert not links.active


async def test_a_stalled_write_of_a_unit_drops_that_unit() -> None:
    links = _links()
    stuck: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    unit = _Unit()
    with links.open(Api.OMNI, None) as link:
        writing = asyncio.create_task(link.write(stuck, 10, unit))
        await asyncio.sleep(0)
        links.sweep(link.write_started + 6.0, stall_s=5.0)
        # The unit's drop fails its stream and aborts the link (``StreamRegistry``).
        assert unit.dropped == ["the client accepted no data for 5 s"]
        stuck.set_result(None)
        await writing
    assert unit.written == [10]


async def test_overlapping_writes_keep_the_clock_of_the_one_still_waiting() -> None:
    """Two contexts write on one socket: when one write returns, the client took data, and
    the other's wait is timed from then, not from its start nor not at all."""
    links = _links()
    loop = asyncio.get_running_loop()
    first: asyncio.Future[None] = loop.create_future()
    second: asyncio.Future[None] = loop.create_future()
    with links.open(Api.ELEVENLABS, None) as link:
        a = asyncio.create_task(link.write(first, 1))
        await asyncio.sleep(0.02)
        b = asyncio.create_task(link.write(second, 2))
        await asyncio.sleep(0)
        started = link.write_started
        first.set_result(None)
        await a
        assert link.write_started > started  # progress restarted the clock; still timed
        second.set_result(None)
        await b
        assert link.write_started == 0.0 and link.bytes_sent == 3


async def test_held_audio_credits_every_unit_it_carries() -> None:
    links = _links()
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    done.set_result(None)
    units = [_Unit(), _Unit()]
    with links.open(Api.OMNI, None) as link:
        await link.write(done, 300, units=units)
        await link.write(done, 0, units=units)  # a control message: no audio
    # The first audio of both; the bytes to the latest (the one that goes on streaming).
    assert [u.written for u in units] == [[0], [300]]
    assert (
        links.metrics.registry.get_sample_value(
            "orpheus_gateway_audio_bytes_sent_total", {"api": "ws"}
        )
        == 300
    )


def test_no_front_end_reaches_the_metrics() -> None:
    """.importlinter's ``frontends-no-metrics`` forbids the import; nor does a front end
    reach them through the gateway (``gateway.metrics``, ``....metrics.``)."""
    no_metrics = contract("frontends-no-metrics")
    assert "source_modules =\n    gateway.frontends\n" in no_metrics
    assert "forbidden_modules =\n    gateway.metrics\n" in no_metrics
    reached = [
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in sorted((REPO / "gateway" / "frontends").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "metrics"
    ]
    assert not reached, reached


def test_a_front_end_importing_the_metrics_is_reported(tmp_path: Path) -> None:
    """The contract is live: a front end that imports ``gateway.metrics`` breaks it, also
    when it is the only thing wrong."""
    front = tmp_path / "gateway" / "frontends"
    front.mkdir(parents=True)
    for init in (tmp_path / "gateway" / "__init__.py", front / "__init__.py"):
        init.write_text("")
    (tmp_path / "gateway" / "metrics.py").write_text("")
    (front / "speech.py").write_text("from gateway import metrics\n")
    res = lint_gateway_with(tmp_path, "frontends-no-metrics")
    assert res.returncode == 1, res.stdout
    assert "gateway.frontends.speech -> gateway.metrics" in res.stdout, res.stdout
