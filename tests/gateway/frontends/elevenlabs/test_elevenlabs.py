"""ElevenLabs' multi-context WebSocket and streaming HTTP, against the gateway with its
synthetic backend (one 2048-sample frame per character of text it is sent)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import aiohttp
import av
import pytest
from elevenlabs_ws import Received, receive_until, ws_path
from gateway_harness import running_gateway, wait_until

from gateway.voices.catalogue import ENGLISH_VOICES
from shm.layout import InstanceLayout
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(60)


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


def alignment_of(messages: list[dict[str, Any]]) -> tuple[str, float]:
    """The characters of all messages, and the sum of their spans (ms)."""
    chars, span = [], 0.0
    for m in messages:
        a = m.get("alignment")
        if a:
            assert a == m["normalizedAlignment"]
            assert a["charStartTimesMs"][0] == 0
            assert len(a["chars"]) == len(a["charStartTimesMs"]) == len(a["charDurationsMs"])
            chars += a["chars"]
            span += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
    return "".join(chars), span


async def test_two_contexts_on_one_socket_and_a_turn_end(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + ws_path("nova")) as ws:
            r = Received()
            await ws.send_json(
                {"text": " ", "context_id": "a", "voice_settings": {"stability": 0.5}}
            )
            await ws.send_json({"text": " ", "context_id": "b"})
            await ws.send_json({"text": "Hello there. How", "context_id": "a"})
            await ws.send_json({"text": "Second context.", "context_id": "b"})
            await ws.send_json({"text": ""})  # keepalive
            await ws.send_json({"text": " are you?", "context_id": "a"})
            await ws.send_json({"context_id": "a", "flush": True})
            await ws.send_json({"context_id": "a", "close_context": True})
            await ws.send_json({"text": "", "context_id": "b", "flush": True})
            await ws.send_json({"context_id": "b", "close_context": True})
            await receive_until(ws, r, lambda: len(r.final) == 2)
            # A second close, a keepalive or a flush for a finished context is ignored (and
            # opens no context); the socket goes on.
            await ws.send_json({"context_id": "a", "close_context": True})
            await ws.send_json({"text": "", "context_id": "a"})
            await ws.send_json({"context_id": "b", "flush": True})
            await ws.send_json({"context_id": "a", "close_context": True})  # no "a" to close
            await ws.send_json({"text": "Third.", "context_id": "c", "flush": True})
            await ws.send_json({"text": "", "context_id": "c", "flush": True})  # turn end
            await ws.send_json({"context_id": "c", "close_context": True})
            await receive_until(ws, r, lambda: len(r.final) == 3)
            await ws.send_json({"close_socket": True})
            assert (await ws.receive(5)).type == aiohttp.WSMsgType.CLOSE
        assert r.errors == []
        assert sorted(r.final) == ["a", "b", "c"]  # one isFinal each, none for a reopened "a"
        assert bytes(r.audio["a"]) == pcm_for(len("Hello there.")) + pcm_for(len("How are you?"))
        assert bytes(r.audio["b"]) == pcm_for(len("Second context."))
        assert bytes(r.audio["c"]) == pcm_for(len("Third."))
        chars, span = alignment_of(r.messages["a"])
        assert chars == " Hello there. How are you?"  # the context-opening " " included
        assert abs(span - len(r.audio["a"]) / 48) < 0.5 * len(r.messages["a"]) + 1
        # Context "a"'s first unit is its first sentence, sent before "How" was complete
        # (context "b"'s unit may be submitted before or after it: the two race).
        texts_of_a = [
            sub.text
            for sub in h.backend.submitted()
            if sub.text not in ("Second context.", "Third.")
        ]
        assert texts_of_a == ["Hello there.", "How are you?"]
        assert {sub.voice for sub in h.backend.submitted()} == {"leah"}
        assert (
            h.metric("orpheus_gateway_requests_total", {"api": "elevenlabs", "outcome": "ok"}) == 4
        )


async def test_barge_in_cancels_upstream_and_other_contexts_go_on(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + ws_path()) as ws:
            r = Received()
            await ws.send_json({"text": " ", "context_id": "turn1"})
            await ws.send_json({"text": "This is a long answer that the user will cut. ",
                                "context_id": "turn1"})  # fmt: skip
            await ws.send_json({"text": "And more of it", "context_id": "turn1"})
            await receive_until(ws, r, lambda: len(r.audio["turn1"]) > 0)
            await ws.send_json({"context_id": "turn1", "close_context": True})  # barge-in
            await receive_until(ws, r, lambda: "turn1" in r.final)
            await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")
            assert len(r.audio["turn1"]) < len(pcm_for(46))
            # the next turn on the same socket
            await ws.send_json({"text": "Okay.", "context_id": "turn2"})
            await ws.send_json({"context_id": "turn2", "flush": True})
            await ws.send_json({"context_id": "turn2", "close_context": True})
            await receive_until(ws, r, lambda: "turn2" in r.final)
        assert bytes(r.audio["turn2"]) == pcm_for(5)
        assert len(h.backend.submitted()) == 2  # "And more of it" was never spoken
        await wait_until(lambda: h.gateway.active_streams == 0, what="slots freed")


async def test_a_second_close_during_delivery_is_a_barge_in(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + ws_path()) as ws:
            r = Received()
            await ws.send_json({"text": "A reply the agent finished writing.", "context_id": "t"})
            await ws.send_json({"context_id": "t", "flush": True})
            await ws.send_json({"context_id": "t", "close_context": True})  # turn end
            await receive_until(ws, r, lambda: len(r.audio["t"]) > 0)
            await ws.send_json({"context_id": "t", "close_context": True})  # user barges in
            await receive_until(ws, r, lambda: "t" in r.final)
        assert len(r.audio["t"]) < len(pcm_for(35))
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")


async def test_bad_messages_do_not_break_other_contexts(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + ws_path()) as ws:
            r = Received()
            await ws.send_json({"text": "Good one. ", "context_id": "ok"})
            await ws.send_str("{not json")
            await ws.send_json({"text": 5, "context_id": "x"})
            await ws.send_json({"flush": True})
            await ws.send_json({"context_id": "ghost", "close_context": True})  # unknown: ignored
            await ws.send_json({"text": "Hi.", "context_id": "bad", "voice_settings": {"speed": 9}})
            await ws.send_json({"context_id": "ok", "flush": True})
            await ws.send_json({"context_id": "ok", "close_context": True})
            await ws.send_json({"text": "late text", "context_id": "ok"})
            await receive_until(ws, r, lambda: "ok" in r.final)
        codes = [e["error"] for e in r.errors]
        assert codes[:4] == ["invalid_message", "invalid_message", "missing_context_id",
                             "invalid_request"]  # fmt: skip
        assert r.errors[3]["contextId"] == "bad"
        assert r.errors[3]["message"] == "Expected `float` <= 4.0 - at `$.speed`"
        assert bytes(r.audio["ok"]) == pcm_for(len("Good one."))

    # A voice this server does not have is refused before the upgrade.
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(h.url + ws_path("nobody"))
        assert e.value.status == 400

    # A voice the worker refuses (known here, gone there) fails its context only.
    others = [v for v in ENGLISH_VOICES if v != "zoe"]
    async with (
        running_gateway(layout, backend={"voices": others}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + ws_path("zoe")) as ws:
            r = Received()
            await ws.send_json({"text": "Hi.", "context_id": "c", "flush": True})
            await receive_until(ws, r, lambda: r.errors != [])
            assert r.errors[0]["contextId"] == "c" and r.errors[0]["code"] == 400
            await ws.send_json({"context_id": "c", "close_context": True})
            await receive_until(ws, r, lambda: "c" in r.final)
        assert h.gateway.active_streams == 0


async def test_handshake_errors_and_api_keys(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["sekret"]) as h, aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(h.url + ws_path())
        assert e.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as e:
            await s.ws_connect(h.url + ws_path(fmt="wav_99"), headers={"xi-api-key": "sekret"})
        assert e.value.status == 400
        async with s.ws_connect(h.url + ws_path(), headers={"xi-api-key": "sekret"}) as ws:
            r = Received()
            await ws.send_json({"text": "Yes.", "context_id": "k"})
            await ws.send_json({"context_id": "k", "flush": True})
            await ws.send_json({"context_id": "k", "close_context": True})
            await receive_until(ws, r, lambda: "k" in r.final)
        assert bytes(r.audio["k"]) == pcm_for(4)


def decoded_seconds(data: bytes) -> tuple[float, int]:
    with av.open(io.BytesIO(data)) as c:
        rate = c.streams.audio[0].rate
        return sum(f.samples for f in c.decode(audio=0)) / rate, rate


@pytest.mark.parametrize(
    "fmt",
    [
        "pcm_16000",
        "pcm_22050",
        "pcm_24000",
        "pcm_44100",
        "ulaw_8000",
        "alaw_8000",
        "mp3_22050_32",
        "mp3_44100_128",
    ],
)
async def test_every_output_format_decodes_to_the_duration(
    layout: InstanceLayout, fmt: str
) -> None:
    text1, text2 = "First sentence here. ", "And a second one."
    seconds = (len(text1.strip()) + len(text2)) * 2048 / 24000
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + ws_path(fmt=fmt)) as ws:
            r = Received()
            await ws.send_json({"text": text1 + text2, "context_id": "f"})
            await ws.send_json({"context_id": "f", "flush": True})
            await ws.send_json({"context_id": "f", "close_context": True})
            await receive_until(ws, r, lambda: "f" in r.final)
        data = bytes(r.audio["f"])
        codec, rate = fmt.split("_")[:2]
        if codec == "mp3":
            got, got_rate = decoded_seconds(data)
            assert got_rate == int(rate)
            assert data.count(b"ID3") <= 1 and data.count(b"Xing") + data.count(b"Info") <= 1
            assert seconds <= got < seconds + 0.15  # one stream: one encoder delay, not two
        else:
            per_s = int(rate) * (1 if codec in ("ulaw", "alaw") else 2)
            assert abs(len(data) / per_s - seconds) < 0.005
        if codec == "ulaw":  # G.711 mu-law decodes back to the tone (within its 8-bit error)
            with av.open(io.BytesIO(data), format="mulaw", options={"sample_rate": "8000"}) as c:
                pcm = b"".join(f.to_ndarray().tobytes() for f in c.decode(audio=0))
            assert abs(len(pcm) / 2 / 8000 - seconds) < 0.005


async def test_http_stream_and_with_timestamps(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["k"]) as h, aiohttp.ClientSession() as s:
        hdr = {"xi-api-key": "k"}
        body = {"text": "Hello world. Bye now.", "model_id": "eleven_turbo_v2_5",
                "voice_settings": {"stability": 0.4}}  # fmt: skip
        url = h.url + "/v1/text-to-speech/tara/stream?output_format=pcm_16000"
        async with s.post(url, json=body, headers=hdr) as resp:
            assert resp.status == 200 and resp.content_type == "audio/pcm"
            audio = await resp.read()
        assert abs(len(audio) / 32000 - 20 * 2048 / 24000) < 0.005
        url = h.url + "/v1/text-to-speech/tara/stream/with-timestamps?output_format=pcm_24000"
        async with s.post(url, json=body, headers=hdr) as resp:
            assert resp.status == 200
            lines = [json.loads(x) for x in (await resp.read()).splitlines() if x.strip()]
        audio = b"".join(base64.b64decode(x["audio_base64"]) for x in lines if "audio_base64" in x)
        assert audio == pcm_for(12) + pcm_for(8)
        chars = [c for x in lines if "alignment" in x for c in x["alignment"]["characters"]]
        assert "".join(chars) == "Hello world. Bye now."
        ends = [
            t
            for x in lines
            if "alignment" in x
            for t in x["alignment"]["character_end_times_seconds"]
        ]
        assert ends == sorted(ends) and ends[-1] == pytest.approx(20 * 2048 / 24000, abs=0.002)
        async with s.post(url, json={"text": " "}, headers=hdr) as resp:
            assert resp.status == 400
        async with s.post(url.replace("tara", "nobody"), json=body, headers=hdr) as resp:
            assert resp.status == 400 and (await resp.json())["error"]["code"] == "bad_request"
        await asyncio.sleep(0)


async def test_voice_settings_speed_time_stretches_the_context(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + ws_path()) as ws:
            r = Received()
            await ws.send_json(
                {"text": " ", "context_id": "fast", "voice_settings": {"speed": 2.0}}
            )
            await ws.send_json({"text": "Twenty characters ok.", "context_id": "fast"})
            await ws.send_json({"context_id": "fast", "flush": True})
            await ws.send_json({"context_id": "fast", "close_context": True})
            await receive_until(ws, r, lambda: "fast" in r.final)
    seconds = len(r.audio["fast"]) / 48000
    assert abs(seconds - 21 * 2048 / 24000 / 2) < 0.1  # atempo 2x, pitch kept
