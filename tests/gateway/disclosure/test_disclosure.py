"""Every audio answer of every front end says it is AI-generated and how it is marked (issue
58, part 4; ``gateway.disclosure``): the headers on the HTTP answers, streamed and whole, and
on the WebSockets' upgrades; ``ai_generated`` and ``watermark`` in vLLM-Omni's ``audio.start``
and ZeroMQ's ``started``. Errors and the routes that answer no audio carry none of it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from elevenlabs import AsyncElevenLabs
from gateway_harness import Harness, running_gateway

from common.config.jobs import JobsConfig
from gateway.app import AUDIO_PATHS, build_app
from gateway.disclosure.headers import AI_DISCLOSURE, AI_GENERATED, WATERMARK, watermark_of
from orpheus_wire.zeromq import Started, server_decoder
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(60)

TEXT = "Hello there."


def _lower(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items()}


def assert_marked(headers: Any, what: str, watermark: str) -> None:
    got = _lower(headers)  # HTTP header names are case-insensitive; some clients lower them
    assert got.get(AI_DISCLOSURE.lower()) == "mode=ai-originated", what
    assert got.get(AI_GENERATED.lower()) == "true", what
    assert got.get(WATERMARK.lower()) == watermark, what


def assert_unmarked(headers: Any, what: str) -> None:
    names = {AI_DISCLOSURE.lower(), AI_GENERATED.lower(), WATERMARK.lower()}
    assert not names & set(_lower(headers)), what


async def post(
    s: aiohttp.ClientSession, h: Harness, path: str, body: dict[str, Any]
) -> tuple[int, Any, bytes]:
    async with s.post(h.url + path, json=body) as r:
        return r.status, r.headers, await r.read()


async def test_every_http_audio_answer_is_marked(layout: InstanceLayout, tmp_path: Path) -> None:
    jobs = JobsConfig(dir=str(tmp_path / "jobs"), poll_s=0.05)
    async with running_gateway(layout, serve={"jobs": jobs}) as h, aiohttp.ClientSession() as s:
        mark = watermark_of(h.config)
        speech = {"model": "tts-1", "input": TEXT, "voice": "tara"}
        el = {"text": TEXT}
        cases = [
            ("/v1/audio/speech", {**speech, "response_format": "pcm"}),
            ("/v1/audio/speech", {**speech, "response_format": "mp3", "stream_format": "sse"}),
            ("/v1/text-to-speech/tara", el),
            ("/v1/text-to-speech/tara/stream", el),
            ("/v1/text-to-speech/tara/with-timestamps", el),
            ("/v1/text-to-speech/tara/stream/with-timestamps", el),
            *(
                (f"/v1/text-to-dialogue{end}", {"inputs": [{"text": TEXT, "voice_id": "tara"}]})
                for end in ("", "/stream", "/with-timestamps", "/stream/with-timestamps")
            ),
            ("/v1/baseten/orpheus/predict", {"prompt": TEXT, "voice": "tara"}),
        ]
        for path, body in cases:
            status, headers, data = await post(s, h, path, body)
            assert status == 200 and data, (path, status, data[:200])
            assert_marked(headers, path, mark)
        # A long-form job's file.
        status, _, data = await post(s, h, "/v1/audio/jobs", {**speech, "response_format": "wav"})
        job = json.loads(data)["id"]
        while (await (await s.get(f"{h.url}/v1/audio/jobs/{job}")).json())["state"] != "done":
            await asyncio.sleep(0.05)
        async with s.get(f"{h.url}/v1/audio/jobs/{job}/audio") as r:
            assert r.status == 200 and await r.read()
            assert_marked(r.headers, "job audio", mark)
        # No audio, no mark: errors, the job's state, the lists.
        status, headers, _ = await post(s, h, "/v1/audio/speech", {**speech, "voice": "nobody"})
        assert status == 400
        assert_unmarked(headers, "an error")
        status, headers, _ = await post(s, h, "/v1/text-to-speech/tara", {"text": " "})
        assert status == 400
        assert_unmarked(headers, "an ElevenLabs error")
        for path in ("/v1/models", "/v1/voices", f"/v1/audio/jobs/{job}", "/health"):
            async with s.get(h.url + path) as r:
                assert r.status == 200
                assert_unmarked(r.headers, path)


async def test_websockets_are_marked_at_the_upgrade_and_in_their_metadata(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        mark = watermark_of(h.config)
        for path in (
            "/v1/text-to-speech/tara/multi-stream-input?output_format=pcm_24000",
            "/v1/text-to-speech/tara/stream-input?output_format=pcm_24000",
            "/v1/baseten/orpheus/websocket",
        ):
            async with s.ws_connect(h.url + path) as ws:
                assert_marked(ws._response.headers, path, mark)
        async with s.ws_connect(h.url + "/v1/audio/speech/stream") as ws:
            assert_marked(ws._response.headers, "omni", mark)
            await ws.send_json(
                {"type": "session.config", "voice": "tara", "response_format": "pcm"}
            )
            await ws.send_json({"type": "input.text", "text": TEXT})
            await ws.send_json({"type": "input.done"})
            while True:
                msg = await ws.receive(10)
                if (
                    msg.type == aiohttp.WSMsgType.TEXT
                    and json.loads(msg.data)["type"] == "audio.start"
                ):
                    start = json.loads(msg.data)
                    break
            assert start["ai_generated"] is True and start["watermark"] == mark
        # An unknown format is refused before the upgrade: no mark.
        async with s.get(h.url + "/v1/text-to-speech/tara/multi-stream-input?output_format=x") as r:
            assert r.status == 400
            assert_unmarked(r.headers, "refused upgrade")


async def test_zeromq_started_says_so(layout: InstanceLayout) -> None:
    async with running_gateway(layout, zmq=True) as h:
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(h.config.gateway.zmq_endpoint or "")
        try:
            await sock.send(
                msgspec.msgpack.encode({"type": "speak", "request_id": 1, "input": TEXT})
            )
            started = server_decoder.decode(await asyncio.wait_for(sock.recv(), 5))
            assert isinstance(started, Started)
            assert started.ai_generated is True and started.watermark == watermark_of(h.config)
            raw = msgspec.msgpack.decode(msgspec.msgpack.encode(started))
            assert raw["ai_generated"] is True and "watermark" in raw  # on the wire
        finally:
            sock.close(linger=0)


async def test_the_audio_paths_are_routes_of_the_app(layout: InstanceLayout) -> None:
    """No stale entry: every path the marker watches is a route the app serves."""
    async with running_gateway(layout) as h:
        served = {r.resource.canonical for r in build_app(h.gateway).router.routes() if r.resource}
    assert set(AUDIO_PATHS) <= served, set(AUDIO_PATHS) - served
    assert len(set(AUDIO_PATHS)) == len(AUDIO_PATHS) == 15


async def test_the_elevenlabs_sdk_reads_a_marked_answer(layout: InstanceLayout) -> None:
    """The official SDK's raw response shows the headers (a client can log them)."""
    async with running_gateway(layout) as h:
        el = AsyncElevenLabs(base_url=h.url, api_key="k")
        async with el.text_to_speech.with_raw_response.stream(
            "tara", text=TEXT, output_format="pcm_24000"
        ) as r:
            assert b"".join([x async for x in r.data])
            assert_marked(r.headers, "sdk", watermark_of(h.config))
