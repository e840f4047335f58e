"""WebSocket /v1/audio/speech/stream: incremental text, ordered PCM, close codes."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from gateway_harness import running_gateway, wait_until

from gateway.synthetic_backend import synthetic_pcm
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)
WS = "/v1/audio/speech/stream"


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


async def collect(ws: aiohttp.ClientWebSocketResponse) -> tuple[bytes, list[dict], int | None]:
    audio = bytearray()
    events: list[dict] = []
    async for msg in ws:
        if msg.type == aiohttp.WSMsgType.BINARY:
            audio += msg.data
        elif msg.type == aiohttp.WSMsgType.TEXT:
            events.append(json.loads(msg.data))
    return bytes(audio), events, ws.close_code


async def test_incremental_text_streams_audio_in_order(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "start", "voice": "nova", "input": "Hi. "})
            started = json.loads((await ws.receive()).data)
            assert started["type"] == "started" and started["sample_rate"] == 24000
            await ws.send_json({"type": "text", "text": "How are "})
            await asyncio.sleep(0.2)  # the voice agent's LLM is still writing
            await ws.send_json({"type": "text", "text": "you?"})
            await ws.send_json({"type": "end"})
            audio, events, code = await collect(ws)
        # The synthetic backend speaks one frame per character of text it received.
        frames = len("Hi. How are you?")
        assert audio == pcm_for(frames)
        assert events[-1]["type"] == "done" and events[-1]["frames"] == frames
        assert code == 1000
        sub = h.backend.submitted()[0]
        assert sub.text_open and sub.voice == "leah" and sub.text == "Hi. "
        assert [a.text for a in h.backend.appends] == ["How are ", "you?", ""]
        assert h.backend.appends[-1].final
        assert h.metric("orpheus_gateway_requests_total", {"api": "ws", "outcome": "ok"}) == 1


async def test_whole_text_in_start_message(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "start", "input": "Hello", "final": True, "max_tokens": 35})
            audio, events, code = await collect(ws)
        assert audio == pcm_for(5) and code == 1000
        assert [e["type"] for e in events] == ["started", "done"]
        assert h.backend.submitted()[0].voice == "tara"  # the default voice


@pytest.mark.parametrize(
    ("messages", "code", "error_code"),
    [
        (["not json"], 4400, "invalid_message"),
        ([{"type": "text", "text": "no start"}], 4400, "invalid_message"),
        ([{"type": "start", "voice": "bad voice!"}], 4400, "invalid_voice"),
        ([{"type": "start", "input": "", "final": True}], 4400, "empty_input"),
        ([{"type": "start", "input": "x", "bogus": 1}], 4400, "invalid_message"),
        ([{"type": "start", "input": "hi"}, {"type": "start"}], 4400, "invalid_message"),
        ([{"type": "start", "input": "hi"}, {"type": "text", "text": "y" * 300}], 4400,
         "input_too_long"),
        ([{"type": "start", "input": "x", "voice": "nobody", "final": True}], 4400, "bad_request"),
    ],
)  # fmt: skip
async def test_bad_messages_close_with_4400_and_a_json_error(
    layout: InstanceLayout, messages: list, code: int, error_code: str
) -> None:
    async with running_gateway(layout, max_input_chars=256) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            for m in messages:
                await (ws.send_str(m) if isinstance(m, str) else ws.send_json(m))
            _, events, close = await collect(ws)
        assert close == code
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == error_code
        await wait_until(lambda: h.gateway.active_streams == 0, what="session closed")
        async with s.get(h.url + "/health") as r:
            assert r.status == 200


async def test_binary_message_and_oversized_frame(layout: InstanceLayout) -> None:
    async with running_gateway(layout, max_body_bytes=1024) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_bytes(b"\x00\x01")
            _, events, close = await collect(ws)
        assert close == 4400 and events[-1]["error"]["code"] == "invalid_message"
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "start", "input": "x" * 2000})
            _, _, close = await collect(ws)
        assert close == 1009  # message too big


async def test_cancel_and_disconnect_stop_upstream(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "start", "input": "x" * 100, "final": True})
            await ws.receive()  # started
            assert (await ws.receive()).type == aiohttp.WSMsgType.BINARY
            await ws.send_json({"type": "cancel"})
            _, _, close = await collect(ws)
        assert close == 1000
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "start", "input": "x" * 100, "final": True})
            await ws.receive()
            await ws.receive()
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 2, what="Cancel on close")
        assert (
            h.metric("orpheus_gateway_requests_total", {"api": "ws", "outcome": "cancelled"}) == 2
        )


async def test_text_idle_and_start_timeouts(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, ws_start_timeout_s=0.3, ws_text_idle_timeout_s=0.3) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as ws:
            _, events, close = await collect(ws)  # never sends start
        assert close == 4408 and events[-1]["error"]["code"] == "timeout"
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "start", "input": "Hi"})
            _, events, close = await collect(ws)  # text stays open, nothing more comes
        assert close == 4408
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")


async def test_auth_header_or_query_parameter(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["secret"]) as h, aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(h.url + WS)
        assert e.value.status == 401
        for kw in (
            {"headers": {"Authorization": "Bearer secret"}},
            {"params": {"api_key": "secret"}},
        ):
            async with s.ws_connect(h.url + WS, **kw) as ws:
                await ws.send_json({"type": "start", "input": "Hey", "final": True})
                audio, _, close = await collect(ws)
            assert close == 1000 and audio == pcm_for(3)


async def test_capacity_close_code(layout: InstanceLayout) -> None:
    async with (
        running_gateway(
            layout, backend={"realtime": True}, max_active_streams=1, max_queued_streams=0
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as first:
            await first.send_json({"type": "start", "input": "x" * 50, "final": True})
            await first.receive()
            async with s.ws_connect(h.url + WS) as second:
                await second.send_json({"type": "start", "input": "x", "final": True})
                _, events, close = await collect(second)
            assert close == 4429 and events[-1]["error"]["code"] == "server_busy"
