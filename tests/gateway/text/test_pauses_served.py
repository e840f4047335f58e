"""Pauses (``<break time="1s"/>``) through a running gateway and its synthetic backend (one
2048-sample frame of tone per character of the text it is sent): the pause is digital
silence of its length at its place, the tag never reaches the model, the alignment shows
the gap, on the OpenAI, ElevenLabs (HTTP and WebSocket, a tag split across two messages)
and ZeroMQ front ends."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from elevenlabs import AsyncElevenLabs
from gateway_harness import running_gateway

from common.config.jobs import JobsConfig
from common.config.text import TextConfig
from gateway.jobs.routes import split_units
from gateway.jobs.runner import fade_edges
from orpheus_client.zmq_client import AsyncClient, SpeechError
from shm.layout import InstanceLayout
from shm.records import FRAME_CODES
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(60)

TEXT = 'Hello there. <break time="1s" /> How are you?'
FIRST, SECOND = "Hello there.", "How are you?"
FRAME_S = 2048 / 24000


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


def silence(seconds: float) -> bytes:
    return bytes(round(seconds * 24000) * 2)


EXPECTED = pcm_for(len(FIRST)) + silence(1.0) + pcm_for(len(SECOND))
"""Each run is a stream of its own (its tone starts again at sample 0), the pause between."""


async def test_openai_http_and_sse(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        body = {"model": "orpheus", "voice": "tara", "input": TEXT, "response_format": "pcm"}
        async with s.post(h.url + "/v1/audio/speech", json=body) as resp:
            assert resp.status == 200
            assert await resp.read() == EXPECTED
        # The model was sent the runs, never the tag; one request, one slot.
        assert [sub.text for sub in h.backend.submitted()] == [FIRST, SECOND]
        assert h.metric("orpheus_gateway_requests_total", {"api": "http", "outcome": "ok"}) == 1
        async with s.post(
            h.url + "/v1/audio/speech", json={**body, "stream_format": "sse"}
        ) as resp:
            events = [json.loads(line[6:]) for line in (await resp.read()).splitlines() if line]
        audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
        assert audio == EXPECTED
        # The pause costs no token: the usage counts the two runs' frames only.
        tokens = (len(FIRST) + len(SECOND)) * FRAME_CODES
        assert events[-1] == {
            "type": "speech.audio.done",
            "usage": {"input_tokens": 0, "output_tokens": tokens, "total_tokens": tokens},
        }
        # A pause at the start and at the end, strength values, several in a row.
        text = '<break strength="weak"/>Hi.<break time="250ms"/><break/> Bye.<break time="0.1s">'
        async with s.post(h.url + "/v1/audio/speech", json={**body, "input": text}) as resp:
            audio = await resp.read()
        assert audio == silence(0.5) + pcm_for(3) + silence(1.0) + pcm_for(4) + silence(0.1)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ('Hi <break time="3.5s"/> there.', "break_too_long"),
        ('Hi <break time="soon"/> there.', "invalid_break"),
        ('Hi <break time="1s" there.', "invalid_break"),
        ('Hi <break strength="huge"/> there.', "invalid_break"),
        ('<break time="1s"/>', "empty_input"),
    ],
)
async def test_bad_or_too_long_breaks_are_a_400(
    layout: InstanceLayout, text: str, code: str
) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        body = {"model": "orpheus", "voice": "tara", "input": text, "response_format": "pcm"}
        async with s.post(h.url + "/v1/audio/speech", json=body) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == code
        url = h.url + "/v1/text-to-speech/tara/stream/with-timestamps"
        async with s.post(url, json={"text": text}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == code
        assert h.backend.submitted() == []


async def test_the_cap_is_configurable(layout: InstanceLayout) -> None:
    async with running_gateway(layout, max_break_s=5.0) as h, aiohttp.ClientSession() as s:
        body = {"model": "orpheus", "voice": "tara", "response_format": "pcm",
                "input": 'Hi. <break time="4s"/> Yo.'}  # fmt: skip
        async with s.post(h.url + "/v1/audio/speech", json=body) as resp:
            assert resp.status == 200
            assert await resp.read() == pcm_for(3) + silence(4.0) + pcm_for(3)


def _absolute(lines: list[dict[str, Any]], key: str) -> tuple[str, list[float], list[float]]:
    chars, starts, ends = [], [], []
    for x in lines:
        a = x.get(key)
        if a:
            chars += a["characters"]
            starts += a["character_start_times_seconds"]
            ends += a["character_end_times_seconds"]
    return "".join(chars), starts, ends


async def test_elevenlabs_http_with_timestamps_shows_the_gap(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/text-to-speech/tara/stream/with-timestamps?output_format=pcm_24000"
        async with s.post(url, json={"text": TEXT}) as resp:
            assert resp.status == 200
            lines = [json.loads(x) for x in (await resp.read()).splitlines() if x.strip()]
        audio = b"".join(base64.b64decode(x["audio_base64"]) for x in lines if x["audio_base64"])
        assert audio == EXPECTED
        assert [sub.text for sub in h.backend.submitted()] == [FIRST, SECOND]
        for key in ("alignment", "normalized_alignment"):
            chars, starts, ends = _absolute(lines, key)
            assert chars == "Hello there.  How are you?"  # the tag's characters are not there
            gap_at = len("Hello there. ")
            speech_end = len(FIRST) * FRAME_S
            assert ends[gap_at - 1] == pytest.approx(speech_end, abs=0.002)
            # Nothing is said during the pause: the next character starts after it.
            assert starts[gap_at] == pytest.approx(speech_end + 1.0, abs=0.002)
            assert ends[-1] == pytest.approx(len(EXPECTED) / 48000, abs=0.002)
            assert starts == sorted(starts)
        url = h.url + "/v1/text-to-speech/tara/stream?output_format=pcm_24000"
        async with s.post(url, json={"text": TEXT}) as resp:
            assert await resp.read() == EXPECTED


async def test_elevenlabs_websocket_with_a_tag_split_across_messages(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        path = "/v1/text-to-speech/tara/multi-stream-input?output_format=pcm_24000"
        async with s.ws_connect(h.url + path) as ws:
            cut = TEXT.index("time=") + 3  # inside the attribute
            await ws.send_json({"text": TEXT[:cut], "context_id": "a"})
            await ws.send_json({"text": TEXT[cut:], "context_id": "a"})
            await ws.send_json({"text": "", "context_id": "a", "flush": True})
            await ws.send_json({"context_id": "a", "close_context": True})
            messages: list[dict[str, Any]] = []
            while True:
                m = json.loads((await ws.receive(20)).data)
                assert "error" not in m, m
                if m.get("isFinal"):
                    break
                messages.append(m)
            # A bad tag is the protocol's error message; the socket goes on.
            await ws.send_json({"text": 'Hi <break time="9s"/>', "context_id": "b"})
            err = json.loads((await ws.receive(20)).data)
            assert (
                err["error"] == "break_too_long" and err["code"] == 400 and err["contextId"] == "b"
            )
        audio = b"".join(base64.b64decode(m["audio"]) for m in messages if m.get("audio"))
        assert audio == EXPECTED
        assert [sub.text for sub in h.backend.submitted()] == [FIRST, SECOND]
        # Pipecat's clock: each message's character times count from the end of the span of
        # the messages before it (the span: its last character's end).
        clock, chars, starts = 0.0, "", []
        for m in messages:
            a = m.get("alignment")
            if a:
                chars += "".join(a["chars"])
                starts += [clock + t for t in a["charStartTimesMs"]]
                clock += a["charStartTimesMs"][-1] + a["charDurationsMs"][-1]
        assert chars == "Hello there.  How are you?"
        speech_end_ms = len(FIRST) * FRAME_S * 1000
        assert starts[len("Hello there. ")] == pytest.approx(speech_end_ms + 1000, abs=2)
        assert clock == pytest.approx(len(EXPECTED) / 48, abs=2)


async def test_zeromq_whole_and_open_text_with_a_tag_split_across_appends(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout, zmq=True) as h:
        async with AsyncClient(h.config.gateway.zmq_endpoint or "") as c:
            audio = b"".join([x async for x in c.speech(TEXT, voice="tara")])
            assert audio == EXPECTED
            async with c.stream("Hello there. <break ti", voice="tara") as st:
                await st.append('me="1s" /> How are')
                await st.append(" you?", final=True)
                audio = b"".join([x async for x in st])
            assert st.done is not None and st.done.reason == "stop"
            # A pause before any word of the open text: its silence first.
            async with c.stream("", voice="tara") as st:
                await st.append('<break time="500ms"/>Hi.', final=True)
                first = b"".join([x async for x in st])
            assert first == silence(0.5) + pcm_for(3)
            # A pause at the end of the open text; a pause, then words after the run before
            # it ended (the next run starts only once they come).
            async with c.stream("Hello ", voice="tara") as st:
                await st.append('<break time="1s"/>')
                await asyncio.sleep(0.3)
                await st.append("", final=True)
                tail = b"".join([x async for x in st])
            assert tail == pcm_for(len("Hello ")) + silence(1.0)
            async with c.stream("Hi. ", voice="tara") as st:
                await st.append('<break time="500ms"/>')
                await asyncio.sleep(0.3)
                await st.append("Bye.")
                await st.append("", final=True)
                later = b"".join([x async for x in st])
            assert later == pcm_for(len("Hi. ")) + silence(0.5) + pcm_for(len("Bye."))
            # A bad tag in an append ends the request with the protocol's Error.
            async with c.stream("Hi. ", voice="tara") as st:
                await st.append('<break time="10s"/>', final=True)
                with pytest.raises(SpeechError) as e:
                    b"".join([x async for x in st])
            assert (e.value.status, e.value.code) == (400, "break_too_long")
        subs = [sub.text for sub in h.backend.submitted()]
        # The open text's first run took what came before the tag (its trailing space too).
        assert subs[:5] == [FIRST, SECOND, "Hello there. ", SECOND, ""]
        assert not [t for t in subs if "<" in t]
        assert audio == pcm_for(len("Hello there. ")) + silence(1.0) + pcm_for(len(SECOND))


async def test_vllm_omni_word_times_show_the_gap(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + "/v1/audio/speech/stream") as ws:
            await ws.send_json({"type": "session.config", "voice": "tara", "response_format": "pcm",
                                "stream_audio": True, "word_timestamps": True})  # fmt: skip
            cut = TEXT.index("time=") + 3
            await ws.send_json({"type": "input.text", "text": TEXT[:cut]})
            await ws.send_json({"type": "input.text", "text": TEXT[cut:]})
            await ws.send_json({"type": "input.done"})
            events: list[dict[str, Any]] = []
            while not events or events[-1]["type"] != "session.done":
                events.append(json.loads((await ws.receive(20)).data))
        assert not [e for e in events if e["type"] == "error"], events
        chunks = [e for e in events if e["type"] == "audio.chunk"]
        assert b"".join(base64.b64decode(c["audio_b64"]) for c in chunks) == EXPECTED
        starts = [e for e in events if e["type"] == "audio.start"]
        assert [e["sentence_text"] for e in starts] == ["Hello there.  How are you?"]  # no tag
        words = [w for c in chunks for w in c["timestamps"] or []]
        assert [w["word"] for w in words] == ["Hello", "there.", "How", "are", "you?"]
        speech_end_ms = len(FIRST) * FRAME_S * 1000
        assert speech_end_ms - 100 < words[1]["end_ms"] <= speech_end_ms + 1
        assert words[2]["start_ms"] >= speech_end_ms + 1000


async def test_baseten_websocket(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + "/v1/baseten/orpheus/websocket") as ws:
            await ws.send_json({"voice": "tara"})
            for piece in ("Hello there.", '<break time="1s"/>', "How are you?", "__END__"):
                await ws.send_str(piece)
            audio = bytearray()
            async for msg in ws:
                audio += msg.data
        assert bytes(audio) == EXPECTED
        assert [sub.text for sub in h.backend.submitted()] == [FIRST, SECOND]


async def test_elevenlabs_dialogue(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/text-to-dialogue/with-timestamps?output_format=pcm_24000"
        async with s.post(url, json={"inputs": [{"text": TEXT, "voice_id": "tara"}]}) as resp:
            assert resp.status == 200
            body = await resp.json()
        assert base64.b64decode(body["audio_base64"]) == EXPECTED
        a = body["alignment"]
        assert "".join(a["characters"]) == "Hello there.  How are you?"
        gap_at = len("Hello there. ")
        speech_end = len(FIRST) * FRAME_S
        assert a["character_start_times_seconds"][gap_at] == pytest.approx(
            speech_end + 1.0, abs=0.002
        )
        bad = {"inputs": [{"text": 'Hi <break time="5s"/>', "voice_id": "tara"}]}
        async with s.post(url, json=bad) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
            assert (err["code"], err["param"]) == ("break_too_long", "inputs[0].text")


def test_job_units_carry_their_pauses() -> None:
    assert split_units('A. <break time="1s"/> B. <break/>', 280) == [
        "A.",
        '<break time="1000ms"/>B.<break time="750ms"/>',
    ]


async def test_a_job_speaks_its_pauses(layout: InstanceLayout, tmp_path: Path) -> None:
    cfg = JobsConfig(dir=str(tmp_path / "jobs"), poll_s=0.05)
    async with (
        running_gateway(layout, serve={"jobs": cfg}) as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"input": TEXT, "voice": "tara", "response_format": "pcm"}
        async with s.post(h.url + "/v1/audio/jobs", json=body) as r:
            assert r.status == 202, await r.text()
            job = await r.json()
        for _ in range(300):
            async with s.get(f"{h.url}/v1/audio/jobs/{job['id']}") as r:
                state = (await r.json())["state"]
            if state == "done":
                break
            await asyncio.sleep(0.05)
        assert state == "done"
        async with s.get(f"{h.url}/v1/audio/jobs/{job['id']}/audio") as r:
            audio = await r.read()
    fade = int(cfg.join_fade_ms * 24)
    first = fade_edges(pcm_for(len(FIRST)), fade)
    second = fade_edges(silence(1.0) + pcm_for(len(SECOND)), fade)
    assert audio == first + second
    assert [sub.text for sub in h.backend.submitted()] == [FIRST, SECOND]


async def test_with_the_sdks_and_normalisation_on(layout: InstanceLayout) -> None:
    """The official SDKs with their defaults; normalisation rewrites the words between the
    tags, never a tag ("1.5s" is not read as a number)."""
    text = 'I have 3 cats. <break time="1.5s"/> And 2 dogs.'
    runs = ["I have three cats.", "And two dogs."]
    serve = {"text": TextConfig(normalization="on")}
    async with running_gateway(layout, serve=serve) as h:
        oa = openai.AsyncOpenAI(base_url=f"{h.url}/v1", api_key="sk-test", max_retries=0)
        resp = await oa.audio.speech.create(
            model="orpheus", voice="nova", input=text, response_format="pcm"
        )
        expected = pcm_for(len(runs[0])) + silence(1.5) + pcm_for(len(runs[1]))
        assert resp.content == expected
        el = AsyncElevenLabs(base_url=h.url, api_key="k")
        chunks = [
            c
            async for c in el.text_to_speech.stream_with_timestamps(
                "tara", text=text, output_format="pcm_24000"
            )
        ]
        audio = b"".join(base64.b64decode(c.audio_base_64) for c in chunks if c.audio_base_64)
        assert audio == expected
        chars = "".join(c for x in chunks if x.alignment for c in x.alignment.characters)
        normalized = "".join(
            c for x in chunks if x.normalized_alignment for c in x.normalized_alignment.characters
        )
        assert chars == "I have 3 cats.  And 2 dogs."
        assert normalized == "I have three cats. And two dogs."
        assert [sub.text for sub in h.backend.submitted()] == runs * 2


async def test_a_pause_keeps_the_request_and_its_slot(layout: InstanceLayout) -> None:
    """Paced as a real-time pipeline: between its two runs the request holds its one slot
    (a second request meanwhile is refused) and its response goes on."""
    async with (
        running_gateway(
            layout, backend={"realtime": True}, max_active_streams=1, max_queued_streams=0
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        body = {"model": "orpheus", "voice": "tara", "input": TEXT, "response_format": "pcm"}
        active: list[int] = []

        async def watch() -> None:
            while True:
                active.append(len(h.gateway.requests))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        async with s.post(h.url + "/v1/audio/speech", json=body) as resp:
            audio = bytearray(await resp.content.readexactly(len(pcm_for(len(FIRST))) + 2))
            # In the pause or the second run: the slot is still this request's.
            async with s.post(h.url + "/v1/audio/speech", json=body) as other:
                assert other.status == 429
            audio += await resp.read()
        watcher.cancel()
        assert bytes(audio) == EXPECTED
        first = active.index(1)
        assert set(active[first : len(active) - active[::-1].index(1)]) == {1}
        assert [sub.text for sub in h.backend.submitted()] == [FIRST, SECOND]
