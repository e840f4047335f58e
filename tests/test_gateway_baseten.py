"""Baseten's Orpheus WebSocket at /v1/baseten/orpheus/websocket (raw protocol; the LiveKit
plugin drives it in test_voice_agent_clients.py)."""

from __future__ import annotations

import aiohttp
import pytest
from gateway_harness import running_gateway, wait_until

from bench.doubles.synthetic_backend import synthetic_pcm
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)
PATH = "/v1/baseten/orpheus/websocket"


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


async def read_all(ws: aiohttp.ClientWebSocketResponse) -> bytes:
    audio = bytearray()
    async for msg in ws:
        assert msg.type == aiohttp.WSMsgType.BINARY
        audio += msg.data
    return bytes(audio)


async def test_words_without_spaces_then_end(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["b"]) as h, aiohttp.ClientSession() as s:
        hdr = {"Authorization": "Api-Key b"}
        async with s.ws_connect(h.url + PATH, headers=hdr) as ws:
            await ws.send_json({"voice": "zoe", "max_tokens": 2000, "buffer_size": 10})
            for word in ["Hello", "world.", "Bye", "now."]:  # the old plugin: one word each
                await ws.send_str(word)
            await ws.send_str("__END__")
            audio = await read_all(ws)
            assert ws.close_code == 1000
        assert [sub.text for sub in h.backend.submitted()] == ["Hello world.", "Bye now."]
        assert audio == pcm_for(12) + pcm_for(8)


async def test_errors_close_with_a_code(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + PATH) as ws:
            await ws.send_json({"voice": "nobody"})
            await ws.send_str("Hi.")
            await ws.send_str("__END__")
            assert await read_all(ws) == b""
            assert ws.close_code == 1008
        async with s.ws_connect(h.url + PATH) as ws:
            await ws.send_str("not json")
            assert await read_all(ws) == b""
            assert ws.close_code == 1008
        async with s.ws_connect(h.url + PATH) as ws:
            await ws.send_json({"voice": "a voice with spaces"})
            assert await read_all(ws) == b""
            assert ws.close_code == 1008
        assert h.gateway.active_streams == 0


async def test_client_close_cancels_upstream(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + PATH) as ws:
            await ws.send_json({"voice": "tara"})
            await ws.send_str("A sentence long enough to be cut off by the caller.")
            await ws.send_str("__END__")
            assert (await ws.receive(10)).type == aiohttp.WSMsgType.BINARY
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")
        await wait_until(lambda: h.gateway.active_streams == 0, what="slot freed")
