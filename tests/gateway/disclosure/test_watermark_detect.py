"""``POST /v1/watermark/detect`` through a real gateway to the codec worker's encode server
with PerTh's detector on it (``gateway.disclosure.detect``, ``codec_worker.watermark.detect``): marked
audio in any format reads as marked, unmarked audio does not, bad input gets a named 4xx."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import av
import numpy as np
import pytest
import torch
from gateway_harness import running_gateway

from codec_worker.encoder import EncodeServer, VoiceEncoder
from codec_worker.snac_model import SNAC_24KHZ_SMALL, fuse_weight_norm
from codec_worker.watermark.detect import ClipDetector
from codec_worker.watermark.perth import PerthWatermark
from shm.layout import InstanceLayout
from store.voices import VoicesConfig
from testkit.clips import wav_bytes
from testkit.tiny_model import random_snac

RATE = 24_000
KEY = "sk-detect"


@pytest.fixture(scope="module")
def perth() -> PerthWatermark:
    return PerthWatermark(torch.device("cpu"))


@pytest.fixture
def detect_server(layout: InstanceLayout, perth: PerthWatermark) -> Iterator[EncodeServer]:
    snac = fuse_weight_norm(random_snac(5, SNAC_24KHZ_SMALL))
    detector = ClipDetector(perth, torch.device("cpu"))
    srv = EncodeServer(VoiceEncoder(snac), layout.encode, detector)
    srv.start()
    yield srv
    srv.stop()


def _speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Noise under a syllable-rate envelope (what the random codec makes is noise too)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    return (0.2 * rng.standard_normal(t.size) * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))).astype(
        np.float32
    )


@torch.inference_mode()
def _marked(perth: PerthWatermark, x: np.ndarray) -> np.ndarray:
    slot = torch.tensor([perth.acquire()])
    return perth.mark(torch.from_numpy(x)[None], slot, torch.tensor([True]))[0].numpy()


def _encoded(x: np.ndarray, fmt: str, codec: str, rate: int, bit_rate: int = 0) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format=fmt) as c:
        stream = c.add_stream(codec, rate=rate, layout="mono")
        if bit_rate:
            stream.bit_rate = bit_rate
        resampler = av.AudioResampler(format=stream.format.name, layout="mono", rate=rate)
        frame = av.AudioFrame.from_ndarray(
            (np.clip(x, -1, 1) * 32767).astype("<i2")[None], format="s16", layout="mono"
        )
        frame.sample_rate = RATE
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            c.mux(stream.encode(f))
        c.mux(stream.encode(None))
    return buf.getvalue()


async def test_detect_reads_marks_in_any_format_and_names_bad_input(
    layout: InstanceLayout, tmp_path: Path, detect_server: EncodeServer, perth: PerthWatermark
) -> None:
    clean = _speechlike(3.0)
    marked = _marked(perth, clean)
    voices = VoicesConfig(state_dir=str(tmp_path), max_upload_bytes=600_000)
    url_of = "{}/v1/watermark/detect"
    async with (
        running_gateway(layout, serve={"voices": voices}, api_keys=[KEY]) as h,
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s,
    ):
        url = url_of.format(h.url)
        bodies = {
            "marked wav": (wav_bytes(marked, RATE), True),
            "marked mp3 32 kbit/s": (_encoded(marked, "mp3", "libmp3lame", 24_000, 32_000), True),
            "marked mu-law wav 8 kHz": (_encoded(marked, "wav", "pcm_mulaw", 8000), True),
            "unmarked wav": (wav_bytes(clean, RATE), False),
        }
        for name, (body, want) in bodies.items():
            async with s.post(url, data=body) as r:
                got = await r.json()
            assert r.status == 200, (name, got)
            print(f"{name}: {got}")
            assert got["marked"] is want and got["watermark"] == "perth", (name, got)
            assert got["score"] >= 0.9 if want else got["score"] <= 0.1
        form = aiohttp.FormData()
        form.add_field("audio", bodies["marked wav"][0], filename="a.wav")
        async with s.post(url, data=form) as r:
            got = await r.json()
        assert r.status == 200 and got["marked"] is True and got["seconds"] == 3.0
        cases = [
            (b"RIFF garbage" * 50, 400, "invalid_audio"),
            (b"", 400, "missing_audio"),
            (wav_bytes(_speechlike(13.0), RATE), 413, "request_too_large"),
        ]
        for body, status, code in cases:
            async with s.post(url, data=body) as r:
                err = await r.json()
            assert (r.status, err["error"]["code"]) == (status, code), err
        async with aiohttp.ClientSession() as anonymous:
            async with anonymous.post(url, data=bodies["marked wav"][0]) as r:
                assert r.status == 401, "the route is behind the API keys"
    assert detect_server.served == 5


async def test_codec_worker_away_is_a_503(layout: InstanceLayout, tmp_path: Path) -> None:
    voices = VoicesConfig(state_dir=str(tmp_path), encode_timeout_s=0.5)
    async with running_gateway(layout, serve={"voices": voices}) as h, aiohttp.ClientSession() as s:
        async with s.post(
            f"{h.url}/v1/watermark/detect", data=wav_bytes(_speechlike(1), RATE)
        ) as r:
            err = await r.json()
        assert r.status == 503 and err["error"]["code"] == "codec_unavailable"
