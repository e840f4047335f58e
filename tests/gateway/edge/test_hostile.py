"""Hostile and careless clients cost bounded resources (issue 27): timeouts, caps and origin
checks on every front end, against a gateway on loopback with its synthetic backend. Each
test is bounded in count and time, and checks afterwards that nothing is left held: no
active stream, no connection counted, no socket of the gateway's port left open, and a
normal request served."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
import pytest
from gateway_harness import Harness, running_gateway, wait_until

from codec_worker.encoder import EncodeServer, VoiceEncoder
from codec_worker.snac_model import SNAC_24KHZ_SMALL, fuse_weight_norm
from common.config.gateway import GatewayConfig
from common.config.llm import LLMConfig
from common.config.text import TextConfig
from gateway.edge.browser_guard import BrowserGuard
from gateway.edge.listener import FD_RESERVE, connection_limit
from gateway.voices.custom_routes import confined_lora_path
from shm.layout import InstanceLayout
from store.voices import VoicesConfig
from testkit.clips import wav_bytes
from testkit.tiny_model import random_snac

pytestmark = pytest.mark.timeout(90)
SPEECH = {"model": "tts-1", "input": "Hello there.", "voice": "alloy", "max_tokens": 70}


def port_sockets(port: int) -> int:
    """This process's TCP sockets on ``port``, either end (the tests' clients and the gateway
    run here): the descriptors a request can leave behind. Counted by port rather than as the
    process's whole descriptor count, which the session's other fixtures move on their own."""
    return sum(
        1
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status != psutil.CONN_LISTEN
        and (c.laddr.port == port or (c.raddr and c.raddr.port == port))
    )


async def assert_recovered(h: Harness) -> None:
    """Nothing held: no stream, no connection, no socket; a normal request served."""
    await wait_until(lambda: h.gateway.active_streams == 0, 10, "no active stream")
    await wait_until(lambda: h.guard.active == 0, 10, "no connection held")
    await wait_until(lambda: port_sockets(h.port) == 0, 10, "no socket of the port left open")
    async with aiohttp.ClientSession() as s, s.post(h.url + "/v1/audio/speech", json=SPEECH) as r:
        assert r.status == 200, await r.text()
        assert len(await r.read()) > 0
    await wait_until(lambda: h.guard.active == 0, 10, "the normal request's connection closed")


async def raw_connect(
    h: Harness, first: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", h.port)
    if first:
        writer.write(first)
        await writer.drain()
    return reader, writer


async def read_to_close(reader: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(reader.read(), timeout)


# -- 1. timeouts and the connection limit --------------------------------------------------
async def test_half_open_requests_are_closed_with_408(layout: InstanceLayout) -> None:
    """Connections that send part of a header, or a header and part of a body, then wait,
    are answered 408 and closed within the configured timeouts."""
    async with running_gateway(layout, header_timeout_s=1.0, body_timeout_s=1.5) as h:
        partial_header = b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"
        body = json.dumps(SPEECH).encode()
        partial_body = (
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body[:10]
        )
        conns = [await raw_connect(h, partial_header) for _ in range(40)]
        conns += [await raw_connect(h, partial_body) for _ in range(10)]
        assert h.guard.active == 50
        trickle = await raw_connect(h, b"GET /health HTTP/1.1\r\n")
        for _ in range(3):  # a slowloris trickle does not extend the deadline
            await asyncio.sleep(0.25)
            trickle[1].write(b"X-A: b\r\n")
        conns.append(trickle)
        answers = await asyncio.gather(*(read_to_close(r, 8.0) for r, _ in conns))
        for i, data in enumerate(answers):
            assert data.startswith(b"HTTP/1.1 408"), (i, data[:200])
            assert b"request_timeout" in data
        for _, w in conns:
            w.close()
        assert h.guard.header_timeouts == 41
        assert h.metric("orpheus_gateway_request_timeouts_total", {"phase": "header"}) == 41
        assert h.metric("orpheus_gateway_request_timeouts_total", {"phase": "body"}) == 10
        await assert_recovered(h)


async def test_idle_keepalive_connections_are_closed(layout: InstanceLayout) -> None:
    async with running_gateway(layout, keepalive_timeout_s=1.0) as h:
        reader, writer = await raw_connect(h, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = await read_to_close(reader, 6.0)  # answered, then closed once idle
        assert data.startswith(b"HTTP/1.1 200") and b'"ok"' in data
        writer.close()
        await assert_recovered(h)


async def test_connections_past_the_limit_are_refused_with_503_and_a_log_line(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_gateway(layout, max_connections=20, header_timeout_s=30.0) as h:
        held = [await raw_connect(h, b"") for _ in range(20)]
        await wait_until(lambda: h.guard.active == 20, 5, "20 held")
        with caplog.at_level(logging.WARNING, logger="gateway.edge.listener"):
            refused = [await raw_connect(h, b"") for _ in range(5)]
            answers = await asyncio.gather(*(read_to_close(r, 5.0) for r, _ in refused))
        for data in answers:
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
            assert json.loads(body)["error"]["code"] == "too_many_connections"
        warnings = [r for r in caplog.records if "connection limit (20)" in r.getMessage()]
        assert len(warnings) == 1, "one line, rate-limited"
        assert h.guard.refused == 5
        assert h.metric("orpheus_gateway_connections_refused_total") == 5
        for _, w in held + refused:
            w.close()
        await assert_recovered(h)


# -- WebSocket inactivity with an utterance open -------------------------------------------
OMNI = "/v1/audio/speech/stream"
BASETEN = "/v1/baseten/orpheus/websocket"
ELEVEN = "/v1/text-to-speech/tara/multi-stream-input?output_format=pcm_24000"


async def drain_ws(ws: aiohttp.ClientWebSocketResponse, timeout: float) -> list[Any]:
    """Every message until the server closes the socket (TimeoutError: it did not)."""
    out: list[Any] = []

    async def run() -> None:
        async for msg in ws:
            out.append(json.loads(msg.data) if msg.type == aiohttp.WSMsgType.TEXT else msg.data)

    await asyncio.wait_for(run(), timeout)
    return out


async def open_omni(s: aiohttp.ClientSession, h: Harness, text: str) -> Any:
    ws = await s.ws_connect(h.url + OMNI)
    await ws.send_json({"type": "session.config", "voice": "tara", "response_format": "pcm",
                        "stream_audio": True, "split_granularity": "sentence"})  # fmt: skip
    await ws.send_json({"type": "input.text", "text": text})
    return ws


@pytest.mark.parametrize("text", ["Hello", "Hello there. And then"])
async def test_omni_socket_with_an_open_utterance_times_out(
    layout: InstanceLayout, text: str
) -> None:
    """An unfinished utterance and then silence: the socket is closed after the idle timeout
    (counted from the end of the audio when a sentence was spoken first)."""
    async with running_gateway(layout, ws_text_idle_timeout_s=1.0) as h:
        async with aiohttp.ClientSession() as s:
            sockets = [await open_omni(s, h, text) for _ in range(10)]
            results = await asyncio.gather(*(drain_ws(ws, 8.0) for ws in sockets))
            for events in results:
                errors = [e for e in events if isinstance(e, dict) and e["type"] == "error"]
                assert [e["code"] for e in errors] == ["timeout"], events
                if "." in text:
                    assert any(isinstance(e, bytes) for e in events), "the sentence was spoken"
            for ws in sockets:
                await ws.close()
        await assert_recovered(h)


async def test_omni_keepalives_count_as_activity(layout: InstanceLayout) -> None:
    """LiveKit keeps a socket alive with empty ``input.done`` messages: that is activity."""
    async with running_gateway(layout, ws_text_idle_timeout_s=1.0) as h:
        async with aiohttp.ClientSession() as s:
            ws = await open_omni(s, h, "Hello")
            loop = asyncio.get_running_loop()
            start = loop.time()
            while loop.time() - start < 2.5:
                await ws.send_json({"type": "input.done"})
                await asyncio.sleep(0.3)
            assert not ws.closed
            t0 = loop.time()
            events = await drain_ws(ws, 8.0)  # then silence: closed
            assert loop.time() - t0 < 5.0
            assert [e["code"] for e in events if isinstance(e, dict) and e["type"] == "error"] == [
                "timeout"
            ]
        await assert_recovered(h)


async def test_baseten_and_elevenlabs_sockets_time_out_after_speaking(
    layout: InstanceLayout,
) -> None:
    """A sentence spoken, then an unfinished one and silence: closed after the timeout."""
    async with running_gateway(layout, ws_text_idle_timeout_s=1.0) as h:
        async with aiohttp.ClientSession() as s:
            b = await s.ws_connect(h.url + BASETEN)
            await b.send_json({"voice": "tara"})
            await b.send_str("Hello there. And then")
            e = await s.ws_connect(h.url + ELEVEN + "&inactivity_timeout=1")
            await e.send_json({"text": " ", "context_id": "c1"})
            await e.send_json({"text": "Hello there. And then", "context_id": "c1"})
            baseten, eleven = await asyncio.gather(drain_ws(b, 8.0), drain_ws(e, 8.0))
            assert any(isinstance(m, bytes) for m in baseten) and b.close_code == 1008
            assert any(isinstance(m, dict) and "audio" in m for m in eleven)
            assert eleven[-1]["error"] == "input_timeout_exceeded"
            await b.close()
            await e.close()
        await assert_recovered(h)


# -- 2. caps on what one client can queue --------------------------------------------------
QUEUE_CAP = {"ws_max_queued_chars": 600, "ws_max_queued_sentences": 40}
FLOOD = 400  # one-word sentences, sent as fast as the socket takes them


async def test_text_queued_on_a_websocket_is_capped(layout: InstanceLayout) -> None:
    """One-word sentences sent faster than they are spoken: past the cap each message is
    refused with ``input_queue_full`` (Baseten: closed with 1013), nothing more is queued,
    and closing the socket leaves nothing behind."""
    async with running_gateway(layout, backend={"realtime": True}, **QUEUE_CAP) as h:
        async with aiohttp.ClientSession() as s:
            omni = await open_omni(s, h, "")
            for _ in range(FLOOD):
                await omni.send_json({"type": "input.text", "text": "Word. "})
            eleven = await s.ws_connect(h.url + ELEVEN)
            for _ in range(FLOOD):
                await eleven.send_json({"text": "Word. ", "context_id": "c1"})
            base = await s.ws_connect(h.url + BASETEN)
            await base.send_json({"voice": "tara"})
            for _ in range(FLOOD):
                if base.closed:
                    break
                await base.send_str("Word. ")

            async def refusals(ws: aiohttp.ClientWebSocketResponse, key: str) -> int:
                n = 0
                while n < FLOOD - 45:
                    msg = await ws.receive(10)
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        n += json.loads(msg.data).get(key) == "input_queue_full"
                return n

            assert await refusals(omni, "code") == FLOOD - 45
            assert await refusals(eleven, "error") == FLOOD - 45
            while (await base.receive(10)).type == aiohttp.WSMsgType.BINARY:
                pass
            assert base.close_code == 1013
            assert h.gateway.active_streams <= 3
            assert len(h.backend.submitted()) < 3 * 45, "nothing past the cap was queued"
            for ws in (omni, eleven, base):
                await ws.close()
        await assert_recovered(h)


async def test_text_without_sentence_ends_on_a_websocket_is_capped(
    layout: InstanceLayout,
) -> None:
    """Words that never end a sentence, normalised: what a socket holds (the text not cut
    into a unit yet, and the units cut at ``UNIT_MAX_CHARS``) counts against the cap, so
    past it each message is refused, as for whole sentences (ZeroMQ's open text:
    tests/gateway/frontends/zeromq/test_zmq.py)."""
    async with running_gateway(
        layout, backend={"realtime": True}, serve={"text": TextConfig()}, **QUEUE_CAP
    ) as h:
        async with aiohttp.ClientSession() as s:
            omni = await open_omni(s, h, "")
            eleven = await s.ws_connect(h.url + ELEVEN)
            base = await s.ws_connect(h.url + BASETEN)
            await base.send_json({"voice": "tara"})
            for _ in range(FLOOD):
                await omni.send_json({"type": "input.text", "text": "word 12 "})
                await eleven.send_json({"text": "word 12 ", "context_id": "c1"})
                if not base.closed:
                    await base.send_str("word 12 ")

            # 600 characters queued and at most one 280-character unit being spoken (the
            # realtime backend takes seconds per unit): the rest of the 3,200 are refused.
            most_taken = (600 + 2 * 280) // len("word 12 ")

            async def refusals(ws: aiohttp.ClientWebSocketResponse, key: str) -> int:
                n = 0
                while n < FLOOD - most_taken:
                    msg = await ws.receive(10)
                    if msg.type == aiohttp.WSMsgType.TEXT:
                        n += json.loads(msg.data).get(key) == "input_queue_full"
                return n

            assert await refusals(omni, "code") == FLOOD - most_taken
            assert await refusals(eleven, "error") == FLOOD - most_taken
            while (await base.receive(10)).type == aiohttp.WSMsgType.BINARY:
                pass
            assert base.close_code == 1013
            spoken = sum(len(sub.text) for sub in h.backend.submitted())
            assert spoken <= 3 * (600 + 2 * 280), "nothing past the cap was queued"
            for ws in (omni, eleven, base):
                await ws.close()
        await assert_recovered(h)


# -- custom-voice uploads ------------------------------------------------------------------
@pytest.fixture
def encode_server(layout: InstanceLayout) -> Iterator[EncodeServer]:
    """The real SNAC encoder (random weights) on the codec worker's encode socket."""
    srv = EncodeServer(
        VoiceEncoder(fuse_weight_norm(random_snac(5, SNAC_24KHZ_SMALL))), layout.encode
    )
    srv.start()
    yield srv
    srv.stop()


def clip(seconds: float) -> bytes:
    t = np.arange(int(seconds * 24_000), dtype=np.float32) / 24_000
    return wav_bytes((0.3 * np.sin(2 * np.pi * 220 * t))[:, None].astype(np.float32), 24_000)


def voice_form(name: str, audio: bytes) -> aiohttp.FormData:
    f = aiohttp.FormData(default_to_multipart=True)
    f.add_field("name", name)
    f.add_field("transcript", "Hello.")
    f.add_field("audio", audio, filename="clip.wav", content_type="audio/wav")
    return f


HELD_UPLOAD = (
    b"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    b"Content-Type: multipart/form-data; boundary=xyz\r\nContent-Length: 1000000\r\n\r\n"
    b'--xyz\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
    b"Content-Type: audio/wav\r\n\r\n" + b"\0" * 4096
)


async def test_voice_uploads_are_capped_and_a_too_long_clip_is_not_encoded(
    layout: InstanceLayout, tmp_path: Path, encode_server: EncodeServer
) -> None:
    serve = {
        "voices": VoicesConfig(state_dir=str(tmp_path), max_seconds=20.0, max_concurrent_uploads=2),
        "llm": LLMConfig(zero_shot=True, voices=["tara", "leah"], max_model_len=700),
    }
    async with running_gateway(layout, serve=serve, body_timeout_s=3.0) as h:
        held = [await raw_connect(h, HELD_UPLOAD) for _ in range(2)]
        custom = h.gateway.custom_voices
        await wait_until(lambda: custom.uploads.in_progress == 2, 5, "two uploads in progress")
        async with aiohttp.ClientSession() as s:
            async with s.post(h.url + "/v1/audio/voices", data=voice_form("a", clip(3.5))) as r:
                err = await r.json()
                assert (r.status, err["error"]["code"]) == (429, "too_many_uploads"), err
                assert r.headers["Retry-After"] == "1"
            answers = await asyncio.gather(*(read_to_close(r, 8.0) for r, _ in held))
            assert all(a.startswith(b"HTTP/1.1 408") for a in answers), answers
            assert custom.uploads.in_progress == 0
            async with s.post(h.url + "/v1/audio/voices", data=voice_form("a", clip(3.5))) as r:
                assert r.status == 201, await r.text()
            assert encode_server.served == 1
            # 10 s is 118 frames, 826 tokens: no room in 700. Refused without encoding.
            async with s.post(h.url + "/v1/audio/voices", data=voice_form("b", clip(10.0))) as r:
                err = await r.json()
                assert (r.status, err["error"]["code"]) == (400, "audio_too_long"), err
            assert encode_server.served == 1
        for _, w in held:
            w.close()
        await assert_recovered(h)


# -- 3. Origin and Host checks for browsers --------------------------------------------------
async def status_code(resp: aiohttp.ClientResponse) -> tuple[int, str | None]:
    body = await resp.read()
    try:
        return resp.status, json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return resp.status, None


async def test_foreign_pages_and_dns_rebinding_are_refused(layout: InstanceLayout) -> None:
    """No API key (the default): a foreign page's simple requests and WebSocket upgrades
    are refused, and so is a foreign Host; no Origin (SDKs) and the same origin are served."""
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        own = f"http://127.0.0.1:{h.port}"
        evil = {"Origin": "https://evil.example"}
        text_body = json.dumps(SPEECH)  # a "simple" request: no preflight
        plain = {"Content-Type": "text/plain"}
        async with s.post(
            h.url + "/v1/audio/speech", data=text_body, headers={**plain, **evil}
        ) as r:
            assert await status_code(r) == (403, "origin_not_allowed")
        form = voice_form("x", b"\0" * 1000)
        async with s.post(h.url + "/v1/audio/voices", data=form, headers=evil) as r:
            assert await status_code(r) == (403, "origin_not_allowed")
        for path in (OMNI, BASETEN, ELEVEN):
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await s.ws_connect(h.url + path, headers=evil)
            assert e.value.status == 403
        rebound = {"Host": f"evil.example:{h.port}", "Origin": f"http://evil.example:{h.port}"}
        for method, path in (
            ("POST", "/v1/audio/speech"),
            ("GET", "/metrics"),
            ("GET", "/v1/models"),
        ):
            async with s.request(method, h.url + path, json=SPEECH, headers=rebound) as r:
                assert await status_code(r) == (403, "host_not_allowed"), path
        async with s.get(h.url + "/ready", headers={"Host": "orpheus-lb"}) as r:
            assert r.status == 200  # probes
        # the same origin (the playground) and no Origin at all are served
        async with s.post(h.url + "/v1/audio/speech", json=SPEECH, headers={"Origin": own}) as r:
            assert r.status == 200 and len(await r.read()) > 0
        async with s.get(h.url + "/", headers={"Host": f"localhost:{h.port}"}) as r:
            assert r.status == 200
        ws = await s.ws_connect(h.url + OMNI, headers={"Origin": own})
        await ws.close()
        await assert_recovered(h)


async def test_allowed_origins_get_cors_and_keys_lift_the_host_check(
    layout: InstanceLayout,
) -> None:
    app = "https://app.example"
    async with (
        running_gateway(layout, allowed_origins=[app], api_keys=["k"]) as h,
        aiohttp.ClientSession() as s,
    ):
        key = {"Authorization": "Bearer k"}
        hdrs = {**key, "Origin": app, "Host": "tts.example.com"}
        async with s.post(h.url + "/v1/audio/speech", json=SPEECH, headers=hdrs) as r:
            assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == app
            await r.read()
        pre = {"Origin": app, "Access-Control-Request-Method": "POST"}
        async with s.options(h.url + "/v1/audio/speech", headers=pre) as r:
            assert r.status == 204 and "Authorization" in r.headers["Access-Control-Allow-Headers"]
        other = {**key, "Origin": "https://other.example"}
        async with s.post(h.url + "/v1/audio/speech", json=SPEECH, headers=other) as r:
            assert await status_code(r) == (403, "origin_not_allowed")


# -- 4. /metrics behind the key, admin keys, adapter paths ---------------------------------
async def test_metrics_can_be_put_behind_the_key(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, api_keys=["k"], admin_keys=["adm"], metrics_require_key=True) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.get(h.url + "/metrics") as r:
            assert await status_code(r) == (401, "invalid_api_key")
        for key in ("k", "adm"):
            async with s.get(h.url + "/metrics", headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200 and "orpheus_gateway_active_streams" in await r.text()
        async with s.get(h.url + "/health") as r:
            assert r.status == 200
    async with running_gateway(layout, api_keys=["k"]) as h, aiohttp.ClientSession() as s:
        async with s.get(h.url + "/metrics") as r:
            assert r.status == 200, "open by default (stated in docs/api.md)"


async def test_admin_calls_need_an_admin_key_and_a_confined_path(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    adapters = tmp_path / "adapters"
    (adapters / "ben").mkdir(parents=True)
    (adapters / "escape").symlink_to("/etc")
    ok_body = {"name": "ben", "path": str(adapters / "ben")}
    real = os.path.realpath(adapters / "ben")
    assert confined_lora_path(str(adapters / "x" / ".." / "ben"), [str(adapters)]) == real
    async with running_gateway(layout, api_keys=["k"]) as h, aiohttp.ClientSession() as s:
        async with s.post(
            h.url + "/v1/admin/lora", json=ok_body, headers={"Authorization": "Bearer k"}
        ) as r:
            assert await status_code(r) == (403, "admin_disabled"), "speech keys open no admin call"
    async with (
        running_gateway(layout, api_keys=["k"], admin_keys=["adm"], lora_dirs=[str(adapters)]) as h,
        aiohttp.ClientSession() as s,
    ):
        speech = {"Authorization": "Bearer k"}
        admin = {"Authorization": "Bearer adm"}
        async with s.post(h.url + "/v1/admin/lora", json=ok_body, headers=speech) as r:
            assert await status_code(r) == (401, "invalid_api_key")
        async with s.delete(h.url + "/v1/admin/lora/ben", headers=speech) as r:
            assert await status_code(r) == (401, "invalid_api_key")
        async with s.post(h.url + "/v1/audio/speech", json=SPEECH, headers=admin) as r:
            assert r.status == 401, "an admin key is not a speech key"
        for path in (
            "/etc",
            str(adapters / ".." / "x"),
            str(adapters / "escape"),
            "org/some-lora",
            "ben",
        ):
            body = {"name": "ben", "path": path}
            async with s.post(h.url + "/v1/admin/lora", json=body, headers=admin) as r:
                assert await status_code(r) == (400, "lora_path_not_allowed"), path


async def test_a_voice_upload_is_spooled_not_held_in_memory(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """A 12 MB upload (under ``voices.max_upload_bytes``) raises the gateway's traced memory
    by far less than its size: the audio goes to a spool file, never into memory twice."""
    serve = {
        "voices": VoicesConfig(state_dir=str(tmp_path)),
        "llm": LLMConfig(zero_shot=True, voices=["tara", "leah"]),
    }
    size = 12 << 20
    head = (
        b'--xyz\r\nContent-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
        b'--xyz\r\nContent-Disposition: form-data; name="transcript"\r\n\r\nHello.\r\n'
        b'--xyz\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
        b"Content-Type: audio/wav\r\n\r\nRIFF"
    )
    tail = b"\r\n--xyz--\r\n"
    length = len(head) + size + len(tail)
    chunk = b"\x01" * (256 << 10)
    async with running_gateway(layout, serve=serve) as h:
        reader, writer = await raw_connect(
            h,
            b"POST /v1/audio/voices HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: multipart/form-data; boundary=xyz\r\n"
            + f"Content-Length: {length}\r\n\r\n".encode(),
        )
        tracemalloc.start()
        try:
            writer.write(head)
            for _ in range(size // len(chunk)):
                writer.write(chunk)
                await writer.drain()
            writer.write(tail)
            answer = await asyncio.wait_for(reader.read(4096), 30)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert answer.startswith(b"HTTP/1.1 400") and b"invalid_audio" in answer, answer
        assert peak < size // 3, f"peak {peak / 2**20:.1f} MiB traced for a 12 MiB upload"
        writer.close()
        await assert_recovered(h)


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("http://[::1]:8000", "[::1]:8000", True),
        ("https://tts.example.com", "tts.example.com", True),  # TLS ended by a proxy
        ("http://tts.example.com", "tts.example.com:80", True),
        ("http://tts.example.com:8080", "tts.example.com", True),  # nginx's $host: no port
        ("http://tts.example.com:8080", "tts.example.com:80", False),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", False),
        ("http://evil.example:8000", "127.0.0.1:8000", False),
        ("null", "127.0.0.1:8000", False),
        ("http://127.0.0.1:8000", None, False),
    ],
)
def test_same_origin_is_the_origins_host_and_port(
    origin: str, host: str | None, same: bool
) -> None:

    assert BrowserGuard(GatewayConfig(), keys_required=False).same_origin(origin, host) is same


def test_hosts_served_without_a_key() -> None:

    guard = BrowserGuard(GatewayConfig(allowed_hosts=["TTS.internal."]), keys_required=False)
    for ok in (
        "127.0.0.1:8000",
        "[::1]",
        "10.0.0.7",
        "localhost:8000",
        "app.localhost",
        "tts.internal:80",
        None,
    ):
        assert guard.host_allowed(ok), ok
    for bad in (
        "evil.example",
        "evil.example:8000",
        "127.0.0.1.evil.example",
        "localhost.evil.example",
    ):
        assert not guard.host_allowed(bad), bad
    assert not BrowserGuard(GatewayConfig(api_keys=["k"]), keys_required=True).check_host
    assert BrowserGuard(GatewayConfig(allowed_origins=["https://app.example/"]), True).listed(
        "https://APP.example"
    )


def test_the_connection_limit_leaves_descriptors_for_the_rest() -> None:

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (600, hard))  # the scale model
    try:
        assert connection_limit(8192) == 600 - FD_RESERVE
        assert connection_limit(100) == 100
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
