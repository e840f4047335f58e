"""Every front end's audio carries the mark (codec.watermark=perth, the default), as PerTh's
own detector reads it (tests/harness/perth_oracle.py), in the formats clients ask for,
telephony's 8 kHz mu-law and Opus at 32 kbit/s included.

One request per front end of the shared default server (``default_server``); the files go to
PerTh's detector in one call. The unmarked control (codec.watermark=off) is the codec
worker's own test (tests/codec/watermark/test_codec_watermark.py): the same engine build as the
server's, without a second engine start here. The server's own detector
(``POST /v1/watermark/detect``) reads the WAV and MP3 answers as marked too.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import time
from collections.abc import Awaitable
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest
from e2e_harness import EXE, Server
from perth_oracle import MARKED, perth_scores, require_oracle, write_wav

from gateway.audio.encoders import ContainerEncoder
from orchestrator.failures import EXIT_PERMANENT
from shm.ring import SHM_DIR
from testkit.local_server import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
FRAMES = 36
"""3 s of audio for the routes that take max_tokens."""
SENTENCES = "One. Two. Three. Four. Five. Six."
"""For the routes that speak a sentence at a time and take no max_tokens: the tiny model's
sentences end where its random weights end them (with seed 1, 3.6 s in all on the
ElevenLabs route)."""


@pytest.fixture
def server(default_server: Server) -> Server:
    return default_server


def decode(data: bytes, fmt: str | None = None, rate: int | None = None) -> tuple[np.ndarray, int]:
    """Mono float audio and its rate, decoded by PyAV (FFmpeg) from any container or raw
    G.711 (``fmt="mulaw"``)."""
    options = {"sample_rate": str(rate), "ch_layout": "mono"} if rate else {}
    with av.open(io.BytesIO(data), format=fmt, options=options) as c:
        stream = c.streams.audio[0]
        out = [f.to_ndarray() for f in c.decode(stream)]
        sr = stream.codec_context.sample_rate
    # Planar frames are (channels, samples), packed ones (1, samples * channels): mono here.
    a = np.concatenate([x.reshape(x.shape[0], -1) for x in out], axis=1).astype(np.float32)
    if np.issubdtype(out[0].dtype, np.integer):
        a /= 32768.0
    return a.mean(axis=0), sr


def pcm24(data: bytes) -> tuple[np.ndarray, int]:
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768.0, 24_000


def opus32(pcm: bytes) -> tuple[np.ndarray, int]:
    """24 kHz PCM through the gateway's Opus encoder at 32 kbit/s, decoded again."""
    enc = ContainerEncoder("opus", 48_000, bitrate="32k")
    try:
        from gateway.audio.output import Resampler

        up = Resampler(48_000)
        ogg = enc.encode(up.encode(pcm) + up.finish()) + enc.finish()
    finally:
        enc.close()
    return decode(ogg)


async def _openai(s: aiohttp.ClientSession, url: str, fmt: str, seed: int) -> bytes:
    body = {"model": "tts-1", "input": "Marked audio, every second of it.", "voice": "tara",
            "response_format": fmt, "max_tokens": 7 * FRAMES, "seed": seed}  # fmt: skip
    async with s.post(f"{url}/v1/audio/speech", json=body) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def _omni(s: aiohttp.ClientSession, url: str) -> bytes:
    async with s.ws_connect(url.replace("http", "ws") + "/v1/audio/speech/stream") as ws:
        await ws.send_json({"type": "session.config", "voice": "tara", "seed": 1,
                            "response_format": "pcm", "stream_audio": True})  # fmt: skip
        await ws.send_json({"type": "input.text", "text": SENTENCES})
        await ws.send_json({"type": "input.done"})
        audio = bytearray()
        async for m in ws:
            if m.type == aiohttp.WSMsgType.BINARY:
                audio += m.data
            elif m.type == aiohttp.WSMsgType.TEXT:
                ev = json.loads(m.data)
                assert ev["type"] != "error", ev
                if ev["type"] == "session.done":
                    break
        return bytes(audio)


async def _elevenlabs_ws(s: aiohttp.ClientSession, url: str) -> bytes:
    ws_url = url.replace("http", "ws") + "/v1/text-to-speech/tara/multi-stream-input"
    async with s.ws_connect(f"{ws_url}?output_format=pcm_24000") as ws:
        await ws.send_json({"text": SENTENCES + " ", "context_id": "c1"})
        await ws.send_json({"context_id": "c1", "flush": True})
        await ws.send_json({"context_id": "c1", "close_context": True})
        audio = bytearray()
        async for m in ws:
            ev = json.loads(m.data)
            assert "error" not in ev, ev
            if ev.get("audio"):
                audio += base64.b64decode(ev["audio"])
            if ev.get("isFinal"):
                break
        return bytes(audio)


async def _job(s: aiohttp.ClientSession, url: str) -> bytes:
    body = {"input": "A long form job. It is marked too.", "voice": "tara",
            "response_format": "wav", "max_tokens": 7 * FRAMES // 2}  # fmt: skip
    async with s.post(f"{url}/v1/audio/jobs", json=body) as r:
        assert r.status == 202, await r.text()
        job = await r.json()
    deadline = time.monotonic() + 180
    while job["state"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        await asyncio.sleep(0.5)
        async with s.get(f"{url}{job['url']}") as r:
            job = await r.json()
    assert job["state"] == "done", job
    async with s.get(f"{url}{job['audio_url']}") as r:
        assert r.status == 200
        return await r.read()


async def _elevenlabs_http(s: aiohttp.ClientSession, url: str) -> bytes:
    el = f"{url}/v1/text-to-speech/tara/stream?output_format=ulaw_8000"
    async with s.post(el, json={"text": SENTENCES, "seed": 1}) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def _dialogue(s: aiohttp.ClientSession, url: str) -> bytes:
    dialogue = {"inputs": [{"text": SENTENCES, "voice_id": "tara"},
                           {"text": SENTENCES, "voice_id": "leo"}], "seed": 1}  # fmt: skip
    async with s.post(f"{url}/v1/text-to-dialogue?output_format=pcm_24000", json=dialogue) as r:
        assert r.status == 200, await r.text()
        return await r.read()


async def _baseten(s: aiohttp.ClientSession, url: str) -> bytes:
    predict = {"prompt": SENTENCES, "voice": "tara", "seed": 1}
    async with s.post(f"{url}/v1/baseten/orpheus/predict", json=predict) as r:
        assert r.status == 200, await r.text()
        return await r.read()


CONCURRENT = 3
"""Requests at once: what the shared server admits and this 2-core machine plays in time."""


async def _collect(url: str) -> tuple[dict[str, bytes], dict[str, tuple[np.ndarray, int]]]:
    gate = asyncio.Semaphore(CONCURRENT)
    async with aiohttp.ClientSession() as s:

        async def one(fetch: Awaitable[bytes]) -> bytes:
            async with gate:
                return await fetch

        names = ["pcm", "ulaw", "mp3", "wav", "el", "el ws", "dialogue", "omni", "baseten", "job"]
        fetched = await asyncio.gather(*(one(f) for f in (
            _openai(s, url, "pcm", 1), _openai(s, url, "ulaw", 2), _openai(s, url, "mp3", 3),
            _openai(s, url, "wav", 4), _elevenlabs_http(s, url), _elevenlabs_ws(s, url),
            _dialogue(s, url), _omni(s, url), _baseten(s, url), _job(s, url),
        )))  # fmt: skip
    raw = dict(zip(names, fetched, strict=True))
    return raw, {
        "openai pcm": pcm24(raw["pcm"]),
        "openai pcm, opus 32 kbit/s": opus32(raw["pcm"]),
        "openai ulaw 8 kHz": decode(raw["ulaw"], "mulaw", 8000),
        "openai mp3": decode(raw["mp3"]),
        "openai wav": decode(raw["wav"]),
        "elevenlabs http ulaw_8000": decode(raw["el"], "mulaw", 8000),
        "elevenlabs websocket": pcm24(raw["el ws"]),
        "elevenlabs dialogue": pcm24(raw["dialogue"]),
        "vllm-omni websocket": pcm24(raw["omni"]),
        "baseten predict": pcm24(raw["baseten"]),
        "long-form job wav": decode(raw["job"]),
    }


async def _detect(url: str, body: bytes) -> dict:
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/watermark/detect", data=body) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def test_every_front_end_s_audio_reads_as_marked(server: Server, tmp_path: Path) -> None:
    require_oracle()
    raw, got = asyncio.run(_collect(server.url))
    from orpheus_client.zmq_client import Client

    with Client(server.zmq_endpoint) as c:
        zmq_pcm = b"".join(c.speech("Hello there.", voice="tara", max_tokens=7 * FRAMES, seed=7))
    got["zeromq"] = pcm24(zmq_pcm)
    files = {}
    for i, (name, (audio, rate)) in enumerate(got.items()):
        assert len(audio) > rate // 4, f"{name}: {len(audio) / rate:.2f} s of audio"
        files[name] = write_wav(tmp_path / f"{i}.wav", audio, rate)
    scores = perth_scores(list(files.values()))
    low = {}
    for name, path in files.items():
        audio, rate = got[name]
        score = scores[str(path)]
        print(f"{name}: {len(audio) / rate:.2f} s at {rate} Hz, PerTh reads {score:.3f}")
        if score < MARKED:
            low[name] = score
    assert not low, f"PerTh reads these as unmarked: {low}"
    # The server's own detector, through the gateway to the codec worker and back.
    for fmt in ("wav", "mp3"):
        detection = asyncio.run(_detect(server.url, raw[fmt]))
        assert detection["marked"] is True and detection["score"] >= MARKED, (fmt, detection)


def test_a_watermark_that_cannot_load_stops_serve_with_78(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A perth package without its network on the path (a broken install): the codec worker
    cannot load the watermark, and the server stops at once with exit 78 and one line naming
    the fix, instead of serving unmarked audio or restarting in a loop."""
    broken = tmp_path / "site" / "perth"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(broken.parent), str(ROOT)]))
    cmd = [EXE, "serve", "--model", str(tiny_model), "--device", "cpu", "--port", str(free_port())]
    shm_before = set(os.listdir(SHM_DIR))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    last = err.strip().splitlines()[-1]
    assert proc.returncode == EXIT_PERMANENT, err[-3000:]
    assert last.startswith("orpheus-serve: the perth watermark cannot load"), last
    assert "codec.watermark=off" in last and "resemble-perth==1.0.1" in last
    assert err.count("restarting in") == 0, "no restart loop"
    left = [n for n in set(os.listdir(SHM_DIR)) - shm_before if n.startswith(f"orpheus-{proc.pid}")]
    assert left == []
