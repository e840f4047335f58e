"""Telephony formats and sample rates on the OpenAI API and ZeroMQ; the output encoders,
the text units and the alignment estimate the streaming protocols share."""

from __future__ import annotations

import base64
import io
import itertools
import json

import aiohttp
import av
import numpy as np
import pytest
from gateway_harness import running_gateway

from gateway.audio.encoders import g711_table
from gateway.audio.formats import ELEVENLABS_FORMATS, OutputFormat
from gateway.audio.output import make_output
from gateway.frontends.alignment import ChunkAligner, word_times
from gateway.frontends.text_units import UnitSplitter
from shm.layout import InstanceLayout
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(60)
BODY = {"model": "tts-1", "voice": "alloy", "input": "Hello caller.", "max_tokens": 7 * 10}
SECONDS = 10 * 2048 / 24000


async def test_openai_ulaw_alaw_and_sample_rates(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/audio/speech"
        for fmt, rate, ctype, per_s in [("ulaw", None, "audio/basic", 8000),
                                        ("alaw", 8000, "audio/x-alaw-basic", 8000),
                                        ("pcm", 16000, "audio/pcm", 32000),
                                        ("pcm", 8000, "audio/pcm", 16000)]:  # fmt: skip
            async with s.post(url, json={**BODY, "response_format": fmt, "sample_rate": rate}) as r:
                assert r.status == 200 and r.content_type == ctype
                data = await r.read()
            assert abs(len(data) / per_s - SECONDS) < 0.005, (fmt, rate)
        async with s.post(url, json={**BODY, "response_format": "wav", "sample_rate": 16000}) as r:
            data = await r.read()
        assert int.from_bytes(data[24:28], "little") == 16000
        async with s.post(url, json={**BODY, "response_format": "mp3", "sample_rate": 44100}) as r:
            with av.open(io.BytesIO(await r.read())) as c:
                assert c.streams.audio[0].rate == 44100
        body = {**BODY, "response_format": "ulaw", "stream_format": "sse"}
        async with s.post(url, json=body) as r:
            events = [
                json.loads(x[6:]) for x in (await r.text()).splitlines() if x.startswith("data: ")
            ]
        audio = b"".join(
            base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"
        )
        assert abs(len(audio) / 8000 - SECONDS) < 0.005
        for bad in [{"response_format": "ulaw", "sample_rate": 16000},
                    {"response_format": "opus", "sample_rate": 22050},
                    {"response_format": "pcm", "sample_rate": 12345}]:  # fmt: skip
            async with s.post(url, json={**BODY, **bad}) as r:
                assert r.status == 400, bad


async def test_zmq_ulaw(layout: InstanceLayout) -> None:
    from orpheus_client.zmq_client import AsyncClient

    async with running_gateway(layout, zmq=True) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint) as c:
            data = b"".join(
                [b async for b in c.speech("Hi.", response_format="ulaw", max_tokens=70)]
            )
    assert abs(len(data) / 8000 - SECONDS) < 0.005


def test_g711_matches_the_standard_tables() -> None:
    u, a = g711_table("ulaw"), g711_table("alaw")
    assert u[32768] == 0xFF and a[32768] == 0xD5  # silence in mu-law and A-law
    assert u[0] == 0x00 and u[65535] == 0x80  # full scale
    x = np.arange(-32768, 32768)
    for law, table in (("mulaw", u), ("alaw", a)):
        with av.open(io.BytesIO(table.tobytes()), format=law, options={"sample_rate": "8000"}) as c:
            back = np.concatenate([f.to_ndarray()[0] for f in c.decode(audio=0)]).astype(int)
        assert len(back) == 65536
        assert np.all(np.abs(back - x) <= np.maximum(np.abs(x) / 16, 16)), law  # 8-bit companding


def test_resampled_formats_keep_the_duration_and_the_tone() -> None:
    pcm = np.concatenate([synthetic_pcm(i * 2048, 2048) for i in range(12)]).tobytes()
    for name, fmt in ELEVENLABS_FORMATS.items():
        enc = make_output(fmt)
        out = b"".join(enc.encode(pcm[i : i + 4096]) for i in range(0, len(pcm), 4096))
        out += enc.finish()
        enc.close()
        if fmt.bytes_per_second:
            assert abs(len(out) / fmt.bytes_per_second - 12 * 2048 / 24000) < 0.002, name
    enc = make_output(OutputFormat("pcm", 16000))
    out = np.frombuffer(enc.encode(pcm) + enc.finish(), dtype="<i2").astype(float)
    seg = out[1600:16000]
    peak_hz = np.argmax(np.abs(np.fft.rfft(seg))) * 16000 / len(seg)
    assert abs(peak_hz - 200) <= 2  # the 200 Hz tone survives


def test_units_cut_at_sentence_ends_as_the_text_arrives() -> None:
    s = UnitSplitter("sentence")
    assert [u.raw for u in s.feed("Hello Dr. Smith. How")] == ["Hello Dr. Smith. "]
    assert [u.text for u in s.feed(" are you? Fine")] == ["How are you?"]
    assert [u.text for u in s.flush()] == ["Fine"] and s.flush() == []
    s = UnitSplitter("sentence", max_chars=20)
    units = s.feed("word " * 10) + s.flush()
    assert all(len(u.raw) <= 20 for u in units) and "".join(u.raw for u in units) == "word " * 10
    none = UnitSplitter("none")
    assert none.feed("One. Two. ") == [] and [u.text for u in none.flush()] == ["One. Two."]


def test_chunk_alignment_spans_add_up_to_the_audio() -> None:
    raw = "Hello there, how are you today? "
    for chunk_ms, chunks in [(85.3, 40), (85.3, 10), (20.0, 200)]:
        al = ChunkAligner(raw)
        chars, span = [], 0
        for i in range(chunks):
            t = al.take(chunk_ms, last=i == chunks - 1)
            if t is not None:
                assert t.charStartTimesMs[0] == 0
                chars += t.chars
                span += t.charStartTimesMs[-1] + t.charDurationsMs[-1]
        assert "".join(chars) == raw
        assert abs(span - chunk_ms * chunks) <= chunks  # integer ms per message
    words = word_times("Hi, you there.", 1000)
    assert [w.word for w in words] == ["Hi,", "you", "there."]
    assert words[0].start_ms == 0 and words[-1].end_ms == 1000
    assert all(a.end_ms <= b.start_ms for a, b in itertools.pairwise(words))
