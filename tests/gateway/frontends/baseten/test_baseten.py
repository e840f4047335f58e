"""Baseten's Orpheus WebSocket at /v1/baseten/orpheus/websocket and its HTTP mode at
/v1/baseten/orpheus/predict (raw protocol; the LiveKit plugin drives both in
test_voice_agent_clients.py)."""

from __future__ import annotations

import aiohttp
import pytest
from gateway_harness import running_gateway, wait_until

from common.config.cache import CacheConfig
from shm.layout import InstanceLayout
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(60)
PATH = "/v1/baseten/orpheus/websocket"
PREDICT = "/v1/baseten/orpheus/predict"


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


async def test_predict_streams_pcm_and_refuses_bad_requests(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["b"]) as h, aiohttp.ClientSession() as s:
        hdr = {"Authorization": "Api-Key b"}
        body = {"prompt": "Hi. Bye.", "voice": "leo", "temperature": 0.5, "language": "en",
                "top_p": 0.9, "repetition_penalty": 1.2, "max_tokens": 2000}  # fmt: skip
        async with s.post(h.url + PREDICT, json=body, headers=hdr) as r:
            assert r.status == 200 and r.headers["Content-Type"] == "audio/pcm"
            assert await r.read() == pcm_for(8)  # headerless: the samples, nothing else
        [sub] = h.backend.submitted()
        assert (sub.text, sub.voice, sub.sampling.temperature) == ("Hi. Bye.", "leo", 0.5)
        assert (sub.sampling.top_p, sub.sampling.repetition_penalty) == (0.9, 1.2)
        assert sub.sampling.max_tokens is None  # an upper bound the server's cap enforces

        async def refused(body: object, headers: dict[str, str] = hdr) -> tuple[int, str]:
            kw = {"data": body} if isinstance(body, bytes) else {"json": body}
            async with s.post(h.url + PREDICT, headers=headers, **kw) as r:  # type: ignore[arg-type]
                return r.status, (await r.json())["error"]["code"]

        assert await refused({"prompt": "Hi."}, {"Authorization": "Api-Key nope"}) == (
            401, "invalid_api_key")  # fmt: skip
        assert await refused(b"{not json") == (400, "invalid_json")
        assert await refused({"voice": "tara"}) == (400, "invalid_request")  # no prompt
        assert await refused({"prompt": "Hi.", "voice": "nobody"}) == (400, "bad_request")
        assert await refused({"prompt": "Hi.", "temperature": 9}) == (400, "invalid_request")
        assert await refused({"prompt": "  "}) == (400, "empty_input")
        assert len(h.backend.submitted()) == 1


async def test_predict_client_gone_cancels_upstream(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"prompt": "A sentence long enough to be cut off by the caller.", "voice": "tara"}
        async with s.post(h.url + PREDICT, json=body) as r:
            assert r.status == 200
            assert await r.content.readany()
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")
        await wait_until(lambda: h.gateway.active_streams == 0, what="slot freed")


async def test_the_cache_in_x_cache_and_not_on_the_socket(layout: InstanceLayout) -> None:
    """``predict`` answers ``X-Cache`` (``miss``, then ``hit`` once stored); the socket, whose
    protocol has no message but audio (the LiveKit plugin reads binary frames until the
    close), says nothing of it: a cached sentence is binary frames and the close."""
    cache = {"cache": CacheConfig(admit_after=1)}
    async with running_gateway(layout, serve=cache) as h, aiohttp.ClientSession() as s:
        body = {"prompt": "Hello world.", "voice": "tara"}
        async with s.post(h.url + PREDICT, json=body) as r:
            assert r.headers["X-Cache"] == "miss" and await r.read() == pcm_for(12)
        name = "orpheus_gateway_cache_stores_total"
        await wait_until(lambda: h.metric(name) >= 1, what="stored")
        async with s.post(h.url + PREDICT, json=body) as r:
            assert r.headers["X-Cache"] == "hit" and await r.read() == pcm_for(12)
        async with s.ws_connect(h.url + PATH) as ws:
            await ws.send_json({"voice": "tara"})
            await ws.send_str("Hello world.")
            await ws.send_str("__END__")
            assert await read_all(ws) == pcm_for(12)  # binary frames only
            assert ws.close_code == 1000
        hits = h.metric("orpheus_gateway_cache_lookups_total", {"result": "hit"})
        assert hits == 2
