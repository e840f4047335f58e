"""The real voice-agent client libraries, unchanged, pointed at the gateway by URL only:
LiveKit's elevenlabs and baseten plugins (orpheus and qwen3-tts/vLLM-Omni protocols) and
Pipecat's ElevenLabs services. The gateway runs with its synthetic backend (one
2048-sample frame per character of text it is sent). Skipped where a package is missing
(they are in the dev extras)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from gateway_harness import running_gateway, wait_until

from shm.layout import InstanceLayout
from testkit.synthetic_backend import synthetic_pcm

pytestmark = pytest.mark.timeout(90)

SR = 24000


async def livekit_stream(tts: object, pieces: list[str]) -> tuple[bytes, int, list[str]]:
    """Push ``pieces`` into a LiveKit SynthesizeStream; the PCM, its rate and the timed
    transcript's words."""
    stream = tts.stream()  # type: ignore[attr-defined]
    for p in pieces:
        stream.push_text(p)
    stream.flush()
    stream.end_input()
    pcm = bytearray()
    rate = 0
    async for ev in stream:
        pcm += bytes(ev.frame.data)
        rate = ev.frame.sample_rate
    await stream.aclose()
    return bytes(pcm), rate, []


async def test_livekit_baseten_orpheus(layout: InstanceLayout) -> None:
    baseten = pytest.importorskip("livekit.plugins.baseten")
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        url = h.url.replace("http://", "ws://") + "/v1/baseten/orpheus/websocket"
        tts = baseten.TTS(model="orpheus", api_key="x", model_endpoint=url, voice="tara",
                          http_session=s)  # fmt: skip
        pcm, rate, _ = await livekit_stream(tts, ["Hello", " there.", " How are", " you?"])
        await tts.aclose()
    assert rate == SR
    assert len(pcm) == (len("Hello there.") + len("How are you?")) * 2048 * 2
    assert [sub.text for sub in h.backend.submitted()] == ["Hello there.", "How are you?"]


async def test_livekit_baseten_orpheus_http(layout: InstanceLayout) -> None:
    """The plugin's HTTP mode (``tts.synthesize()``, an http(s) endpoint), its defaults: the
    key as ``Api-Key``, ``{prompt, voice, temperature, language}``, headerless 24 kHz PCM."""
    baseten = pytest.importorskip("livekit.plugins.baseten")
    async with running_gateway(layout, api_keys=["bk"]) as h, aiohttp.ClientSession() as s:
        url = h.url + "/v1/baseten/orpheus/predict"
        tts = baseten.TTS(model="orpheus", api_key="bk", model_endpoint=url, http_session=s)
        text = "Hello there. How are you?"
        pcm = bytearray()
        rate = 0
        async with tts.synthesize(text) as stream:
            async for ev in stream:
                pcm += bytes(ev.frame.data)
                rate = ev.frame.sample_rate
        await tts.aclose()
    assert rate == SR
    frames = range(len(text))
    want = b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in frames)
    # LiveKit's emitter ends the segment with at most 10 ms of silence.
    assert pcm[: len(want)] == want
    assert len(pcm) - len(want) <= SR // 100 * 2 and not any(pcm[len(want) :])
    [sub] = h.backend.submitted()
    assert (sub.text, sub.voice) == (text, "tara")
    assert sub.sampling.temperature == 0.6
    assert h.metric("orpheus_gateway_requests_total", {"api": "baseten", "outcome": "ok"}) == 1


@pytest.mark.parametrize("word_timestamps", [False, True])  # the plugin's default, then on
async def test_livekit_baseten_qwen3_speaks_vllm_omni(
    layout: InstanceLayout, word_timestamps: bool
) -> None:
    baseten = pytest.importorskip("livekit.plugins.baseten")
    async with running_gateway(layout, api_keys=["key"]) as h, aiohttp.ClientSession() as s:
        url = h.url.replace("http://", "ws://") + "/v1/audio/speech/stream"
        tts = baseten.TTS(model="qwen3-tts", api_key="key", model_endpoint=url, voice="leo",
                          word_timestamps=word_timestamps, http_session=s)  # fmt: skip
        # The plugin leaves split_granularity to vLLM-Omni's default ("none"): each flush is
        # one unit to it, spoken here sentence by sentence.
        pcm, rate, _ = await livekit_stream(tts, ["Two turns. ", "On one socket."])
        pcm2, _, _ = await livekit_stream(tts, ["Second turn."])
        await tts.aclose()
    assert rate == SR
    assert len(pcm) == len("Two turns.On one socket.") * 2048 * 2
    assert len(pcm2) == len("Second turn.") * 2048 * 2
    assert {sub.voice for sub in h.backend.submitted()} == {"leo"}
    assert [sub.text for sub in h.backend.submitted()] == [
        "Two turns.", "On one socket.", "Second turn."]  # fmt: skip


@pytest.mark.parametrize("encoding", ["pcm_24000", "pcm_16000", "mp3_44100_128"])
async def test_livekit_elevenlabs(layout: InstanceLayout, encoding: str) -> None:
    elevenlabs = pytest.importorskip("livekit.plugins.elevenlabs")
    async with running_gateway(layout, api_keys=["el"]) as h, aiohttp.ClientSession() as s:
        tts = elevenlabs.TTS(api_key="el", base_url=h.url + "/v1", voice_id="tara",
                             encoding=encoding, http_session=s)  # fmt: skip
        text = ["Hello ", "there. ", "How are ", "you today?"]
        pcm, rate, _ = await livekit_stream(tts, text)
        pcm2, _, _ = await livekit_stream(tts, ["And again."])  # the same socket, a new context
        await tts.aclose()
    seconds = (len("Hello there.") + len("How are you today?")) * 2048 / SR
    want_rate = int(encoding.split("_")[1])
    assert rate == want_rate
    got = len(pcm) / 2 / rate
    assert seconds - 0.01 <= got <= seconds + (0.15 if encoding.startswith("mp3") else 0.01)
    assert len(pcm2) / 2 / rate == pytest.approx(10 * 2048 / SR, abs=0.15)
    assert h.metric("orpheus_gateway_requests_total", {"api": "elevenlabs", "outcome": "ok"}) == 3


async def test_livekit_elevenlabs_interruption_cancels_upstream(layout: InstanceLayout) -> None:
    elevenlabs = pytest.importorskip("livekit.plugins.elevenlabs")
    async with (
        running_gateway(layout, backend={"realtime": True}) as h,
        aiohttp.ClientSession() as s,
    ):
        tts = elevenlabs.TTS(api_key="x", base_url=h.url + "/v1", voice_id="tara",
                             encoding="pcm_24000", http_session=s)  # fmt: skip
        stream = tts.stream()
        stream.push_text("This answer is long enough to be interrupted half way through. ")
        stream.push_text("It goes on")
        got = 0
        async for ev in stream:
            got += len(bytes(ev.frame.data))
            break  # the user speaks: the agent drops this speech
        await stream.aclose()
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")
        await tts.aclose()
        await wait_until(lambda: h.gateway.active_streams == 0, what="slots freed")
    assert got > 0
    await asyncio.sleep(0)


async def pipecat_speak(service: object, texts: list[str]) -> list[object]:
    """Run Pipecat's own test pipeline around ``service`` with ``TTSSpeakFrame``s."""
    from pipecat.frames.frames import TTSSpeakFrame
    from pipecat.tests.utils import run_test

    down, _ = await run_test(
        service,  # type: ignore[arg-type]
        frames_to_send=[TTSSpeakFrame(t) for t in texts],
    )
    return list(down)


@pytest.mark.parametrize("sample_rate", [16000, 24000])
async def test_pipecat_elevenlabs_websocket(layout: InstanceLayout, sample_rate: int) -> None:
    pytest.importorskip("pipecat.services.elevenlabs.tts")
    from pipecat.frames.frames import TTSAudioRawFrame, TTSTextFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService

    async with running_gateway(layout, api_keys=["pk"]) as h:
        service = ElevenLabsTTSService(api_key="pk", settings=ElevenLabsTTSService.Settings(voice="tara"),
                                       url=h.url.replace("http://", "ws://"),
                                       sample_rate=sample_rate)  # fmt: skip
        frames = await pipecat_speak(service, ["Hello there, friend.", "Second turn."])
    audio = b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame))
    words = [f.text for f in frames if isinstance(f, TTSTextFrame)]
    seconds = (len("Hello there, friend.") + len("Second turn.")) * 2048 / SR
    assert len(audio) / 2 / sample_rate == pytest.approx(seconds, abs=0.01)
    assert "friend." in " ".join(words) and "turn." in " ".join(words)
    assert [sub.text for sub in h.backend.submitted()] == ["Hello there, friend.", "Second turn."]


async def test_pipecat_elevenlabs_http(layout: InstanceLayout) -> None:
    pytest.importorskip("pipecat.services.elevenlabs.tts")
    from pipecat.frames.frames import TTSAudioRawFrame, TTSTextFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsHttpTTSService

    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        service = ElevenLabsHttpTTSService(api_key="x", settings=ElevenLabsHttpTTSService.Settings(voice="tara"), aiohttp_session=s,
                                           base_url=h.url, sample_rate=22050)  # fmt: skip
        frames = await pipecat_speak(service, ["One sentence. And two."])
    audio = b"".join(f.audio for f in frames if isinstance(f, TTSAudioRawFrame))
    words = [f.text for f in frames if isinstance(f, TTSTextFrame)]
    assert len(audio) / 2 / 22050 == pytest.approx(21 * 2048 / SR, abs=0.01)  # 13 + 8 chars
    assert "two." in " ".join(words)


async def test_pipecat_elevenlabs_interruption_cancels_upstream(layout: InstanceLayout) -> None:
    pytest.importorskip("pipecat.services.elevenlabs.tts")
    from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame, TTSSpeakFrame
    from pipecat.services.elevenlabs.tts import ElevenLabsTTSService
    from pipecat.tests.utils import SleepFrame, run_test

    async with running_gateway(layout, backend={"realtime": True}) as h:
        service = ElevenLabsTTSService(api_key="x", settings=ElevenLabsTTSService.Settings(voice="tara"),
                                       url=h.url.replace("http://", "ws://"),
                                       sample_rate=24000)  # fmt: skip
        text = "A long reply that the user talks over before it is half done."
        down, _ = await run_test(
            service,
            frames_to_send=[TTSSpeakFrame(text), SleepFrame(1.0), InterruptionFrame()],
        )
        await wait_until(lambda: len(h.backend.cancelled_ids()) == 1, what="Cancel upstream")
        await wait_until(lambda: h.gateway.active_streams == 0, what="slot freed")
    audio = b"".join(f.audio for f in down if isinstance(f, TTSAudioRawFrame))
    assert 0 < len(audio) < len(text) * 2048 * 2


async def test_pipecat_elevenlabs_websocket_with_a_dictionary_and_normalisation(
    layout: InstanceLayout, tmp_path: object
) -> None:
    """Pipecat's own ``pronunciation_dictionary_locators`` (sent on each context's first
    message) and ``apply_text_normalization`` (the socket's query): the model is given the
    rewritten text, and the words Pipecat attributes back to the conversation are the ones
    it sent (``alignment`` is over the sent text)."""
    pytest.importorskip("pipecat.services.elevenlabs.tts")
    import msgspec
    from pipecat.frames.frames import TTSTextFrame
    from pipecat.services.elevenlabs.tts import (
        ElevenLabsTTSService,
        PronunciationDictionaryLocator,
    )

    from common.config.text import TextConfig
    from store.voices import VoicesConfig

    serve = {"voices": VoicesConfig(state_dir=str(tmp_path)), "text": TextConfig()}
    async with running_gateway(layout, serve=serve) as h, aiohttp.ClientSession() as s:
        rules = [{"type": "alias", "string_to_replace": "Kubernetes", "alias": "koo-ber-net-eez"}]
        async with s.post(
            f"{h.url}/v1/pronunciation-dictionaries/add-from-rules",
            json={"name": "k", "rules": rules},
        ) as r:
            d = msgspec.json.decode(await r.read())
        service = ElevenLabsTTSService(
            api_key="pk", url=h.url.replace("http://", "ws://"), sample_rate=SR,
            settings=ElevenLabsTTSService.Settings(voice="tara", apply_text_normalization="on"),
            pronunciation_dictionary_locators=[
                PronunciationDictionaryLocator(
                    pronunciation_dictionary_id=d["id"], version_id=d["version_id"]
                )
            ],
        )  # fmt: skip
        frames = await pipecat_speak(service, ["Kubernetes has 3 nodes."])
    assert [sub.text for sub in h.backend.submitted()] == ["koo-ber-net-eez has three nodes."]
    words = " ".join(f.text for f in frames if isinstance(f, TTSTextFrame))
    assert "Kubernetes" in words and "nodes." in words
