"""vLLM-Omni's streaming speech WebSocket at /v1/audio/speech/stream, against the gateway
with its synthetic backend (one 2048-sample frame per character of text it is sent)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from typing import Any

import aiohttp
import av
import pytest
from gateway_harness import running_gateway, wait_until

from gateway.disclosure.headers import watermark_of
from gateway.voices.catalogue import ENGLISH_VOICES
from shm.layout import InstanceLayout
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(60)
WS = "/v1/audio/speech/stream"


def pcm_for(frames: int, start_frame: int = 0) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(start_frame, frames))


async def read_until(
    ws: aiohttp.ClientWebSocketResponse, kind: str, timeout: float = 20.0
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Events and binary frames up to and including the first event of type ``kind``."""
    events: list[dict[str, Any]] = []
    frames: list[bytes] = []
    while True:
        msg = await ws.receive(timeout)
        if msg.type == aiohttp.WSMsgType.BINARY:
            frames.append(msg.data)
            continue
        assert msg.type == aiohttp.WSMsgType.TEXT, msg
        ev = json.loads(msg.data)
        events.append(ev)
        if ev["type"] == kind:
            return events, frames


async def test_two_utterances_stream_pcm_on_one_socket(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "voice": "nova", "response_format": "pcm",
                                "stream_audio": True, "task_type": "Base", "language": "Auto"})  # fmt: skip
            for piece in ("Hi there. ", "How are", " you?"):
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            starts = [e for e in events if e["type"] == "audio.start"]
            dones = [e for e in events if e["type"] == "audio.done"]
            # vLLM-Omni's default split_granularity "none": the flush is one unit to the
            # client, though the gateway spoke it sentence by sentence (below).
            assert starts == [{"type": "audio.start", "utterance_index": 0, "sentence_index": 0,
                               "sentence_text": "Hi there. How are you?", "format": "pcm",
                               "sample_rate": 24000, "channels": 1, "ai_generated": True,
                               "watermark": watermark_of(h.config)}]  # fmt: skip
            audio = b"".join(frames)
            assert audio == pcm_for(len("Hi there.")) + pcm_for(len("How are you?"))
            assert [d["total_bytes"] for d in dones] == [21 * 4096]
            assert not any(d["error"] for d in dones)
            assert events[-1] == {
                "type": "session.done",
                "utterance_index": 0,
                "total_sentences": 1,
            }

            # The session stays open: a second utterance, then an empty flush answers at once.
            await ws.send_json({"type": "input.text", "text": "Again."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert events[-1] == {
                "type": "session.done",
                "utterance_index": 1,
                "total_sentences": 1,
            }
            assert b"".join(frames) == pcm_for(6)
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert events == [{"type": "session.done", "utterance_index": 2, "total_sentences": 0}]
            await ws.send_json({"type": "session.close"})
            msg = await ws.receive(5)
            assert msg.type == aiohttp.WSMsgType.CLOSE
        assert [sub.text for sub in h.backend.submitted()] == [
            "Hi there.", "How are you?", "Again."]  # fmt: skip
        assert all(sub.voice == "leah" and not sub.text_open for sub in h.backend.submitted())
        assert h.metric("orpheus_gateway_requests_total", {"api": "ws", "outcome": "ok"}) == 3


async def test_default_wav_is_one_file_per_sentence_and_config_is_replaced(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "voice": "tara"})
            await ws.send_json({"type": "input.text", "text": "One two three."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert len(frames) == 1
            with av.open(io.BytesIO(frames[0])) as c:
                samples = sum(f.samples for f in c.decode(audio=0))
            assert samples == 14 * 2048
            assert events[0]["format"] == "wav"
            # A later session.config replaces the config: mp3 at 22050 Hz, not streamed.
            await ws.send_json({"type": "session.config", "voice": "leo",
                                "response_format": "mp3", "sample_rate": 22050})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "Four."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            with av.open(io.BytesIO(frames[0])) as c:
                assert c.streams.audio[0].rate == 22050
                n = sum(f.samples for f in c.decode(audio=0))
            assert abs(n / 22050 - 5 * 2048 / 24000) < 0.12
        assert h.backend.submitted()[-1].voice == "leo"


async def test_telephony_ulaw_and_word_timestamps(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "ulaw",
                                "sample_rate": 8000, "stream_audio": True,
                                "timestamp_type": "word"})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "Hello big world."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            # 8 kHz, one byte per sample; the resampler keeps its last ~16 samples (2 ms).
            assert 0 <= 16 * 2048 // 3 - len(b"".join(frames)) <= 24
            done = next(e for e in events if e["type"] == "audio.done")
            wa = done["timestamp_info"]["word_alignment"]
            assert wa["words"] == ["Hello", "big", "world."]
            assert wa["word_start_times_seconds"][0] == 0
            assert wa["word_end_times_seconds"][-1] == pytest.approx(16 * 2048 / 24000, abs=0.002)
            assert wa["word_start_times_seconds"] == sorted(wa["word_start_times_seconds"])

            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True, "word_timestamps": True})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "Hi you."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert frames == []
            chunks = [e for e in events if e["type"] == "audio.chunk"]
            audio = b"".join(base64.b64decode(c["audio_b64"]) for c in chunks)
            assert audio == pcm_for(7)
            assert [w["word"] for w in chunks[-1]["timestamps"]] == ["Hi", "you."]
            assert all(c["timestamps"] is None for c in chunks[:-1])


async def test_bad_messages_get_errors_and_the_session_goes_on(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "input.text", "text": "no config"})
            ev = json.loads((await ws.receive(5)).data)
            assert ev["type"] == "error" and "session.config" in ev["message"]
            assert (await ws.receive(5)).type == aiohttp.WSMsgType.CLOSE

        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "mp3",
                                "stream_audio": True})  # fmt: skip
            ev = json.loads((await ws.receive(5)).data)
            assert ev["type"] == "error" and "stream_audio" in ev["message"]
            assert (await ws.receive(5)).type == aiohttp.WSMsgType.CLOSE

        async with s.ws_connect(h.url + WS) as ws:  # a voice this server does not have
            await ws.send_json({"type": "session.config", "voice": "nobody"})
            ev = json.loads((await ws.receive(5)).data)
            assert ev["type"] == "error" and ev["code"] == "bad_request"
            assert ev["message"].startswith("Invalid session config: unknown voice 'nobody'")
            assert (await ws.receive(5)).type == aiohttp.WSMsgType.CLOSE

    # "zoe" is a voice here and the worker refuses it: its sentence fails, the session goes on.
    others = [v for v in ENGLISH_VOICES if v != "zoe"]
    async with (
        running_gateway(layout, backend={"voices": others}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True, "voice": "zoe"})  # fmt: skip
            await ws.send_json({"type": "session.config", "voice": "nobody"})  # refused, kept zoe
            await ws.send_str("{not json")
            await ws.send_json({"type": "dance"})
            await ws.send_json({"type": "input.text", "text": 5})
            await ws.send_json({"type": "input.text", "text": "Fails."})
            await ws.send_json({"type": "input.done"})
            events, _ = await read_until(ws, "session.done")
            errors = [e for e in events if e["type"] == "error"]
            assert [e["code"] for e in errors] == ["bad_request", "invalid_json",
                "invalid_message", "invalid_message", "bad_request"]  # fmt: skip
            assert next(e for e in events if e["type"] == "audio.done")["error"] is True
            await ws.send_json({"type": "session.config", "voice": "tara", "response_format": "pcm",
                                "stream_audio": True})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "Works."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert b"".join(frames) == pcm_for(6)


async def test_closing_the_socket_cancels_the_stream_upstream(layout: InstanceLayout) -> None:
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "A long sentence to be cut off."})
            await ws.send_json({"type": "input.done"})
            while (await ws.receive(10)).type != aiohttp.WSMsgType.BINARY:
                pass
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")
        await wait_until(lambda: h.gateway.active_streams == 0, what="slot freed")
        await asyncio.sleep(0)


async def test_split_granularity_and_config_during_an_utterance(layout: InstanceLayout) -> None:
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "One. Two. "})
            await ws.send_json({"type": "session.config", "response_format": "wav"})
            await ws.send_json({"type": "input.text", "text": "Three."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            errors = [e for e in events if e["type"] == "error"]
            assert errors[0]["code"] == "utterance_in_progress"
            starts = [e for e in events if e["type"] == "audio.start"]
            assert [e["sentence_text"] for e in starts] == ["One. Two. Three."]  # one per flush
            assert events[-1]["total_sentences"] == 1
            # Still pcm (the config was refused), spoken as three units.
            assert b"".join(frames) == pcm_for(4) + pcm_for(4) + pcm_for(6)

            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True, "split_granularity": "clause"})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "First of all, we start; "})
            await ws.send_json({"type": "input.text", "text": "then we go."})
            await ws.send_json({"type": "input.done"})
            events, _ = await read_until(ws, "session.done")
            starts = [e["sentence_text"] for e in events if e["type"] == "audio.start"]
            # vLLM-Omni's clauses: at once after , and ;, after . ! ? and whitespace.
            assert starts == ["First of all,", "we start;", "then we go."]
            assert [e["sentence_index"] for e in events if e["type"] == "audio.done"] == [0, 1, 2]
            assert events[-1]["total_sentences"] == 3

            # Its sentences: no abbreviation list ("Mr." is one), a decimal point is not an end.
            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True, "split_granularity": "sentence"})  # fmt: skip
            for piece in ("Mr. Smith paid 3", ".50 dollars. Really?"):
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            starts = [e["sentence_text"] for e in events if e["type"] == "audio.start"]
            assert starts == ["Mr.", "Smith paid 3.50 dollars.", "Really?"]
            assert b"".join(frames) == pcm_for(3) + pcm_for(24) + pcm_for(7)


async def test_none_speaks_before_the_flush_and_shows_one_unit(layout: InstanceLayout) -> None:
    """With vLLM-Omni's default a flush is one unit to the client, but its sentences are
    spoken as they complete: the first is generated before the flush, its audio held until
    the unit's text is known, then sent, in order, with the rest."""
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True, "timestamp_type": "word"})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "Hi there. "})
            await wait_until(lambda: len(h.backend.submitted()) == 1, what="first sentence sent")
            await wait_until(lambda: h.gateway.active_streams == 0, what="first sentence spoken")
            with pytest.raises(TimeoutError):  # nothing is shown before the unit is complete
                await ws.receive(0.3)
            await ws.send_json({"type": "input.text", "text": "Bye."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"]
            assert events[0]["sentence_text"] == "Hi there. Bye."
            assert b"".join(frames) == pcm_for(9) + pcm_for(4)
            done = events[1]
            assert (done["sentence_index"], done["total_bytes"], done["error"]) == (
                0,
                13 * 4096,
                False,
            )
            wa = done["timestamp_info"]["word_alignment"]
            assert wa["words"] == ["Hi", "there.", "Bye."]
            # The second spoken unit's words are on the shown unit's clock.
            assert wa["word_start_times_seconds"][2] >= 9 * 2048 / 24000
            assert wa["word_end_times_seconds"][-1] == pytest.approx(13 * 2048 / 24000, abs=0.002)

            # Not streamed: one file for the whole unit, across its spoken units.
            await ws.send_json({"type": "session.config", "response_format": "wav"})
            for piece in ("One. ", "Two three."):
                await ws.send_json({"type": "input.text", "text": piece})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"]
            assert len(frames) == 1
            with av.open(io.BytesIO(frames[0])) as c:
                assert sum(f.samples for f in c.decode(audio=0)) == 14 * 2048
            assert events[1]["total_bytes"] == len(frames[0])
        assert [sub.text for sub in h.backend.submitted()] == [
            "Hi there.", "Bye.", "One.", "Two three."]  # fmt: skip


async def test_a_failed_spoken_unit_fails_its_shown_unit(layout: InstanceLayout) -> None:
    """Over capacity for the second sentence of a flush: the one shown unit reports the
    error (after the audio already sent) and ``audio.done`` with ``error: true``; its
    remaining sentences are not spoken; the session goes on."""
    others = [v for v in ENGLISH_VOICES if v != "zoe"]
    async with (
        running_gateway(layout, backend={"voices": others}) as h,
        aiohttp.ClientSession() as s,
    ):
        async with s.ws_connect(h.url + WS) as ws:
            await ws.send_json({"type": "session.config", "response_format": "pcm",
                                "stream_audio": True, "voice": "zoe"})  # fmt: skip
            await ws.send_json({"type": "input.text", "text": "One. Two. Three."})
            await ws.send_json({"type": "input.done"})
            events, frames = await read_until(ws, "session.done")
            assert [e["type"] for e in events] == [
                "audio.start", "error", "audio.done", "session.done"]  # fmt: skip
            assert events[1]["code"] == "bad_request" and "sentence 0" in events[1]["message"]
            assert events[2]["error"] is True and events[2]["total_bytes"] == 0
            assert frames == []
            assert len(h.backend.submitted()) == 1  # Two. and Three. were not spoken
