"""POST /v1/audio/speech and the info endpoints, against a gateway fed by the synthetic
backend over the real control socket and PCM ring (tests/harness/gateway_harness.py)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import logging
import socket

import aiohttp
import av
import numpy as np
import openai
import pytest
from gateway_harness import BYTES_PER_FRAME, running_gateway, wait_until

from common.config.llm import LLMConfig
from gateway.voices.catalogue import ENGLISH_VOICES
from shm.layout import InstanceLayout
from shm.messages import ClusterStatus, EngineStatus, LlmSubmit
from shm.records import StreamError
from testkit.synthetic_backend import StreamPlan, default_plan, synthetic_pcm

pytestmark = pytest.mark.timeout(60)
FRAMES = 12


def body(**kw: object) -> dict[str, object]:
    return {"model": "tts-1", "input": "Hello there.", "voice": "alloy",
            "max_tokens": 7 * FRAMES, **kw}  # fmt: skip


def expected_pcm(frames: int = FRAMES) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


def decoded_samples(data: bytes) -> int:
    with av.open(io.BytesIO(data)) as c:
        frames = list(c.decode(audio=0))
    return sum(f.samples for f in frames) * 24000 // frames[0].sample_rate


def unread_speech(port: int, max_tokens: int) -> socket.socket:
    """A client that asks for ``max_tokens`` of PCM and never reads the answer: a socket with
    a 4 KiB receive buffer, the request sent."""
    req = json.dumps(body(response_format="pcm", max_tokens=max_tokens)).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(
        b"POST /v1/audio/speech HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(req)}\r\n\r\n".encode()
        + req
    )
    return sock


def scripted(submit: LlmSubmit) -> StreamPlan:
    """Per-request behaviour chosen by the text (the test fixture's script)."""
    text = submit.text
    if text == "error-after-2":
        return StreamPlan(frames=10, error=StreamError("engine_error", "boom", 500), error_after=2)
    if text == "gap-at-2":
        return StreamPlan(frames=10, skip_seq_at=2)
    if text == "silent":
        return StreamPlan(frames=10, stall_after=0)
    return default_plan(ENGLISH_VOICES)(submit)


CONTENT_TYPES = {"pcm": "audio/pcm", "wav": "audio/wav", "mp3": "audio/mpeg",
                 "opus": "audio/opus", "aac": "audio/aac", "flac": "audio/flac"}  # fmt: skip
TOLERANCE = {"pcm": 0, "wav": 0, "flac": 0, "opus": 480, "mp3": 2400, "aac": 2048}


async def test_each_format_streams_and_decodes_to_the_right_length(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        for fmt, ctype in CONTENT_TYPES.items():
            async with s.post(f"{h.url}/v1/audio/speech", json=body(response_format=fmt)) as r:
                assert r.status == 200, await r.text()
                assert r.headers["Content-Type"] == ctype
                assert r.headers.get("Transfer-Encoding") == "chunked"
                data = await r.read()
            n = FRAMES * 2048
            if fmt == "pcm":
                assert data == expected_pcm()
            elif fmt == "wav":
                assert data[:4] == b"RIFF" and data[44:] == expected_pcm()
                assert decoded_samples(data) == n
            else:
                assert abs(decoded_samples(data) - n) <= TOLERANCE[fmt], fmt
        assert h.metric("orpheus_gateway_requests_total", {"api": "http", "outcome": "ok"}) == 6


async def test_concurrent_streams_each_get_their_own_audio(layout: InstanceLayout) -> None:
    async with running_gateway(layout, backend={"realtime": True}) as h:
        async with aiohttp.ClientSession() as s:

            async def one(frames: int) -> bytes:
                req = body(response_format="pcm", max_tokens=7 * frames)
                async with s.post(f"{h.url}/v1/audio/speech", json=req) as r:
                    assert r.status == 200
                    return await r.read()

            lengths = [3 + i % 7 for i in range(40)]
            results = await asyncio.gather(*(one(n) for n in lengths))
        for n, data in zip(lengths, results, strict=True):
            assert data == expected_pcm(n)
        assert h.gateway.active_streams == 0 and len(h.gateway.registry) == 0


async def test_sse_events_parse_and_carry_the_audio(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        for fmt in ("pcm", "mp3"):
            req = body(response_format=fmt, stream_format="sse")
            async with s.post(f"{h.url}/v1/audio/speech", json=req) as r:
                assert r.status == 200
                assert r.headers["Content-Type"] == "text/event-stream"
                raw = (await r.read()).decode()
            events = [json.loads(block[len("data: ") :]) for block in raw.split("\n\n") if block]
            assert all(b.startswith("data: ") for b in raw.split("\n\n") if b)
            assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
            assert events[-1]["type"] == "speech.audio.done"
            assert events[-1]["usage"]["output_tokens"] == 7 * FRAMES
            audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
            if fmt == "pcm":
                assert audio == expected_pcm()
            else:
                assert abs(decoded_samples(audio) - FRAMES * 2048) <= TOLERANCE[fmt]


async def test_openai_sdk_streaming_call_works_unchanged(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["sk-test"]) as h:
        client = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="sk-test", max_retries=0)
        async with client.audio.speech.with_streaming_response.create(
            model="gpt-4o-mini-tts", voice="coral", input="Hello from the SDK.",
            response_format="pcm", speed=1.0, extra_body={"max_tokens": 7 * FRAMES},
        ) as resp:  # fmt: skip
            assert resp.headers["content-type"] == "audio/pcm"
            chunks = [c async for c in resp.iter_bytes()]
        assert b"".join(chunks) == expected_pcm()
        async with client.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input="Default format is mp3.",
            extra_body={"max_tokens": 7 * FRAMES},
        ) as resp:  # fmt: skip
            assert resp.headers["content-type"] == "audio/mpeg"
            mp3 = await resp.read()
        assert abs(decoded_samples(mp3) - FRAMES * 2048) <= TOLERANCE["mp3"]
        bad = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.audio.speech.create(model="tts-1", voice="alloy", input="x")
        with pytest.raises(openai.BadRequestError) as e:
            await client.audio.speech.create(model="tts-1", voice="nobody", input="x")
        assert e.value.status_code == 400 and "unknown voice" in str(e.value)
        await client.close()
        await bad.close()


async def test_info_endpoints(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.get(f"{h.url}/v1/audio/voices") as r:
            voices = await r.json()
        assert voices["voices"] == list(ENGLISH_VOICES) and voices["default"] == "tara"
        assert len(voices["aliases"]) == 13 and voices["aliases"]["alloy"] == "tara"
        async with s.get(f"{h.url}/v1/models") as r:
            ids = [m["id"] for m in (await r.json())["data"]]
        assert "tts-1" in ids and "gpt-4o-mini-tts" in ids
        async with s.get(f"{h.url}/health") as r:
            assert r.status == 200 and (await r.json()) == {"status": "ok"}
        async with s.get(f"{h.url}/ready") as r:
            assert r.status == 200 and (await r.json())["ready"] is True
        async with s.post(f"{h.url}/v1/audio/speech", json=body(response_format="pcm")) as r:
            await r.read()
        async with s.get(f"{h.url}/metrics") as r:
            text = await r.text()
            assert r.headers["Content-Type"].startswith("text/plain")
        for name in ("orpheus_gateway_ttfb_seconds_bucket", "orpheus_gateway_rtf_bucket",
                     "orpheus_gateway_active_streams", "orpheus_gateway_audio_bytes_sent_total",
                     "orpheus_gateway_slow_client_drops_total"):  # fmt: skip
            assert name in text, name
        assert 'orpheus_gateway_requests_total{api="http",outcome="ok"} 1.0' in text
        sent = h.metric("orpheus_gateway_audio_bytes_sent_total", {"api": "http"})
        assert sent == FRAMES * BYTES_PER_FRAME


async def test_malformed_requests_get_4xx_json_and_the_server_stays_healthy(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout, max_body_bytes=2048, max_input_chars=200) as h:
        url = f"{h.url}/v1/audio/speech"
        cases: list[tuple[str, str, bytes | None, dict[str, str], int]] = [
            ("POST", url, b"{not json", {}, 400),
            ("POST", url, b"\xff\xfe\x00garbage", {}, 400),
            ("POST", url, b"[1, 2]", {}, 400),
            ("POST", url, b"", {}, 400),
            ("POST", url, json.dumps(body(voice=7)).encode(), {}, 400),
            ("POST", url, json.dumps(body(input="x" * 201)).encode(), {}, 400),
            ("POST", url, json.dumps(body(input="")).encode(), {}, 400),
            ("POST", url, json.dumps(body(response_format="ogg")).encode(), {}, 400),
            ("POST", url, json.dumps(body(speed=0)).encode(), {}, 400),
            ("POST", url, json.dumps(body(seed=-1)).encode(), {}, 400),
            ("POST", url, json.dumps(body(voice="a\nb")).encode(), {}, 400),
            ("POST", url, json.dumps(body(input="a\x00b")).encode(), {}, 400),
            ("POST", url, b"{" + b" " * 4096 + b"}", {}, 413),
            ("GET", url, None, {}, 405),
            ("POST", f"{h.url}/v1/nope", b"{}", {}, 404),
            ("DELETE", f"{h.url}/v1/models", None, {}, 405),
        ]
        async with aiohttp.ClientSession() as s:
            for method, target, data, headers, status in cases:
                async with s.request(method, target, data=data, headers=headers) as r:
                    assert r.status == status, (data, await r.text())
                    assert r.headers["Content-Type"].startswith("application/json")
                    err = (await r.json())["error"]
                    assert err["message"] and err["type"] and err["code"]

            async def chunked_body():  # no Content-Length: the limit applies while reading
                for _ in range(8):
                    yield b" " * 1024

            async with s.post(url, data=chunked_body()) as r:
                assert r.status == 413
            async with s.get(f"{h.url}/health") as r:
                assert r.status == 200
            async with s.post(url, json=body(response_format="pcm")) as r:
                assert r.status == 200 and await r.read() == expected_pcm()
        assert h.gateway.active_streams == 0 and h.gateway.admission.active == 0


async def test_api_keys(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["k1", "k2"]) as h, aiohttp.ClientSession() as s:
        url = f"{h.url}/v1/audio/speech"
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic k1"}):
            async with s.post(url, json=body(), headers=headers) as r:
                assert r.status == 401
                assert (await r.json())["error"]["code"] == "invalid_api_key"
        async with s.get(f"{h.url}/v1/models") as r:
            assert r.status == 401
        async with s.post(
            url, json=body(response_format="pcm"), headers={"Authorization": "Bearer k2"}
        ) as r:
            assert r.status == 200 and await r.read() == expected_pcm()
        for open_path in ("/health", "/ready", "/metrics"):
            async with s.get(h.url + open_path) as r:
                assert r.status == 200, open_path


async def test_client_disconnect_cancels_upstream(layout: InstanceLayout) -> None:
    async with running_gateway(layout, backend={"realtime": True}) as h:
        async with aiohttp.ClientSession() as s:
            long = body(response_format="pcm", max_tokens=7 * 200)
            async with s.post(f"{h.url}/v1/audio/speech", json=long) as r:
                assert r.status == 200
                await r.content.readexactly(2048)
            # Leaving the block closed the connection with the stream unfinished.
            await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")
            # Before the first audio, too.
            task = asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=long))
            await wait_until(lambda: len(h.backend.submitted()) == 2, what="second Submit")
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 2, what="second Cancel")
        assert {s.stream_id for s in h.backend.submitted()} == h.backend.cancelled_ids()
        await wait_until(lambda: h.gateway.active_streams == 0, what="sessions closed")
        assert (
            h.metric("orpheus_gateway_requests_total", {"api": "http", "outcome": "cancelled"}) == 2
        )


async def test_first_chunk_delay_then_disconnect_before_audio(layout: InstanceLayout) -> None:
    backend = {"realtime": True, "first_chunk_delay_s": 5.0}
    async with running_gateway(layout, backend=backend) as h:
        timeout = aiohttp.ClientTimeout(total=0.3)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            with pytest.raises(TimeoutError):
                async with s.post(f"{h.url}/v1/audio/speech", json=body()) as r:
                    await r.read()
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")


async def test_failures_after_audio_are_never_mistaken_for_a_whole_stream(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout, backend={"plan": scripted}) as h:
        async with aiohttp.ClientSession() as s:
            for text in ("error-after-2", "gap-at-2"):
                async with s.post(f"{h.url}/v1/audio/speech", json=body(input=text)) as r:
                    assert r.status == 200  # the first audio came first
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await r.read()
            req = body(input="error-after-2", stream_format="sse", response_format="pcm")
            async with s.post(f"{h.url}/v1/audio/speech", json=req) as r:
                raw = (await r.read()).decode()
            events = [json.loads(b[6:]) for b in raw.split("\n\n") if b]
            # The audio before the failure, in one or more deltas (what arrived together is
            # sent together), then the error event.
            assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
            audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
            assert len(audio) == 2 * 2048 * 2, "both frames before the failure were delivered"
            assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "engine_error"
        gap_ids = {sub.stream_id for sub in h.backend.submitted() if sub.text == "gap-at-2"}
        await wait_until(lambda: gap_ids <= h.backend.cancelled_ids(), what="Cancel after gap")
        assert h.metric("orpheus_gateway_pcm_sequence_errors_total") == 1


async def test_silent_upstream_times_out_with_504(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"plan": scripted}, upstream_idle_timeout_s=0.3) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.post(f"{h.url}/v1/audio/speech", json=body(input="silent")) as r:
            assert r.status == 504
            assert (await r.json())["error"]["code"] == "upstream_timeout"
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")


async def test_worker_restart_fails_streams_in_flight(layout: InstanceLayout) -> None:
    backend = {"realtime": True, "first_chunk_delay_s": 30.0}
    async with running_gateway(layout, backend=backend) as h, aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=body()))
        await wait_until(lambda: len(h.backend.submitted()) == 1, what="Submit")
        h.backend.status = ClusterStatus(
            engines=(EngineStatus(True, generation=1),), codec_ready=True, draining=False
        )
        r = await asyncio.wait_for(task, 5)
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "worker_restarted"
        assert r.headers["Retry-After"] == "1"  # gateway.retry_after_s: retrying helps
        r.release()
        assert (
            h.metric(
                "orpheus_gateway_requests_total", {"api": "http", "outcome": "worker_restarted"}
            )
            == 1
        )


async def test_a_background_task_that_dies_breaks_the_gateway(layout: InstanceLayout) -> None:
    """A bug that ends the status task must not leave a gateway that looks healthy and never
    hears of a worker's restart again: ``broken`` says which task ended and why (gateway.main
    then exits, and the orchestrator restarts the process)."""
    async with running_gateway(layout) as h:
        assert not h.gateway.broken.done()

        def bug(_status: ClusterStatus) -> None:
            raise RuntimeError("a bug in the status handler")

        h.gateway.cluster.on_change(bug)
        h.backend.status = ClusterStatus(
            engines=(EngineStatus(True),), codec_ready=True, draining=False, codec_generation=1
        )
        why = await asyncio.wait_for(h.gateway.broken, 5)
        assert "cluster-status" in why and "a bug in the status handler" in why


async def test_workers_not_ready_is_503_and_not_ready(layout: InstanceLayout) -> None:
    status = ClusterStatus(engines=(EngineStatus(False),), codec_ready=True, draining=False)
    async with running_gateway(layout, backend={"status": status}) as h:
        await wait_until(lambda: h.gateway.cluster.status is not None, what="status")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{h.url}/ready") as r:
                assert r.status == 503
                assert "llm_worker not ready" in (await r.json())["reasons"]
            async with s.post(f"{h.url}/v1/audio/speech", json=body()) as r:
                assert r.status == 503 and r.headers["Retry-After"] == "1"
                assert (await r.json())["error"]["code"] == "workers_not_ready"


async def test_admission_limits_queue_and_retry_after(layout: InstanceLayout) -> None:
    async with running_gateway(
        layout, backend={"realtime": True}, max_active_streams=1, max_queued_streams=1,
        retry_after_s=3,
    ) as h, aiohttp.ClientSession() as s:  # fmt: skip
        url = f"{h.url}/v1/audio/speech"

        async def get(frames: int) -> tuple[int, bytes]:
            async with s.post(url, json=body(response_format="pcm", max_tokens=7 * frames)) as r:
                return r.status, await r.read()

        first = asyncio.create_task(get(20))
        await wait_until(lambda: h.gateway.admission.active == 1, what="first admitted")
        queued = asyncio.create_task(get(3))
        await wait_until(lambda: h.gateway.admission.queued == 1, what="second queued")
        async with s.get(f"{h.url}/ready") as r:
            assert r.status == 503
        async with s.post(url, json=body()) as r:
            assert r.status == 429 and r.headers["Retry-After"] == "3"
            assert (await r.json())["error"]["type"] == "rate_limit_error"
        assert await first == (200, expected_pcm(20))
        assert await queued == (200, expected_pcm(3))
        assert (
            h.metric("orpheus_gateway_requests_total", {"api": "http", "outcome": "rejected"}) == 1
        )


async def test_drain_refuses_new_streams_and_lets_active_ones_finish(
    layout: InstanceLayout,
) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        url = f"{h.url}/v1/audio/speech"
        async with s.post(url, json=body(response_format="pcm")) as r:
            assert r.status == 200
            drain = asyncio.create_task(h.gateway.drain(10.0))
            await asyncio.sleep(0.05)
            async with s.post(url, json=body()) as r2:
                assert r2.status == 503 and "Retry-After" in r2.headers
                assert (await r2.json())["error"]["code"] == "draining"
            async with s.get(f"{h.url}/ready") as r3:
                assert r3.status == 503
            assert await r.read() == expected_pcm()
        assert await drain is True


async def test_slow_client_is_dropped_without_growing_memory(layout: InstanceLayout) -> None:
    async with running_gateway(layout, max_buffered_seconds=0.5, client_stall_timeout_s=30) as h:
        sock = unread_speech(h.port, max_tokens=7 * 400)
        try:  # never read: the server's buffers fill, then the stream must be dropped
            await wait_until(lambda: h.metric("orpheus_gateway_slow_client_drops_total") == 1,
                             timeout_s=10, what="slow-client drop")  # fmt: skip
            await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel")
            await wait_until(lambda: h.gateway.active_streams == 0, what="session closed")
        finally:
            sock.close()
        assert (
            h.metric("orpheus_gateway_requests_total", {"api": "http", "outcome": "slow_client"})
            == 1
        )


async def test_stalled_client_is_dropped_by_the_watchdog(layout: InstanceLayout) -> None:
    async with running_gateway(
        layout,
        max_buffered_seconds=600,
        client_stall_timeout_s=0.5,
        serve={"llm": LLMConfig(max_tokens_cap=7 * 2500)},
    ) as h:
        # More audio than the kernel's socket buffers hold (about 10 MB), far less than the
        # buffer limit: only the stall watchdog can notice that the client does not read.
        # (Over the default llm.max_tokens_cap of one generation: raised.)
        sock = unread_speech(h.port, max_tokens=7 * 2500)
        try:
            await wait_until(lambda: h.metric("orpheus_gateway_slow_client_drops_total") == 1,
                             timeout_s=10, what="stall drop")  # fmt: skip
            await wait_until(lambda: h.gateway.active_streams == 0, what="session closed")
        finally:
            sock.close()


def test_pcm_fixture_is_a_tone() -> None:
    x = np.frombuffer(expected_pcm(2), dtype="<i2")
    assert x.max() > 7000 and len(x) == 4096


async def test_one_log_line_per_stream_at_its_end(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="orpheus.streams")
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.post(f"{h.url}/v1/audio/speech", json=body(response_format="pcm")) as r:
            assert r.status == 200
            await r.read()
        await asyncio.sleep(0.05)
    (line,) = [rec for rec in caplog.records if rec.name == "orpheus.streams"]
    f = line.fields  # type: ignore[attr-defined]
    assert f["outcome"] == "ok" and f["api"] == "http"
    assert f["audio_s"] == round(FRAMES * 2048 / 24000, 3)
    assert f["ttfb_s"] is not None and f["ttfb_s"] >= 0 and f["rtf"] is not None
