"""Every ``output_format`` the official ``elevenlabs`` SDK declares, read from the SDK at test
time (the ``Literal`` of each call's ``output_format`` parameter, not a copy of it), answers on
every ElevenLabs route (``convert``, ``stream``, their ``with-timestamps`` variants, the
multi-context WebSocket) and decodes with PyAV at its declared rate, in its declared container
(issue 58, part 0): ``wav_*`` a WAV file, ``opus_48000_*`` Ogg Opus at 48 kHz near its bit
rate, ``mp3_*`` MP3 at its bit rate, ``pcm_*``/``ulaw_8000``/``alaw_8000`` raw samples."""

from __future__ import annotations

import base64
import io
import json
import struct
import typing
from collections.abc import Callable
from typing import Any

import aiohttp
import av
import pytest
from elevenlabs import AsyncElevenLabs
from elevenlabs.core.api_error import ApiError
from elevenlabs.text_to_dialogue.client import AsyncTextToDialogueClient
from elevenlabs.text_to_speech.client import AsyncTextToSpeechClient
from gateway_harness import Harness, running_gateway

from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(180)

TEXT = "Hello world. Bye now."
"""Two units: 20 synthetic frames of 2048 samples."""
SECONDS = 20 * 2048 / 24000
RAW_FORMATS = {"pcm": "s16le", "ulaw": "mulaw", "alaw": "alaw"}
"""PyAV's demuxer of each headerless codec (the rate is the format name's)."""
CONTAINERS = {"wav": ("wav", "pcm_s16le"), "mp3": ("mp3", "mp3"), "opus": ("ogg", "opus")}
"""The container and codec PyAV finds in each coded format."""


def declared_formats(call: Callable[..., Any]) -> list[str]:
    """The ``output_format`` names an SDK call declares (its Literal, wherever it is nested)."""
    hint = typing.get_type_hints(call)["output_format"]
    names: list[str] = []
    todo = [hint]
    while todo:
        t = todo.pop()
        if typing.get_origin(t) is typing.Literal:
            names += [a for a in typing.get_args(t) if isinstance(a, str)]
        else:
            todo += typing.get_args(t)
    assert names, f"{call.__qualname__} declares no output_format names"
    return sorted(set(names))


CONVERT = declared_formats(AsyncTextToSpeechClient.convert)
STREAM = declared_formats(AsyncTextToSpeechClient.stream)
CONVERT_TS = declared_formats(AsyncTextToSpeechClient.convert_with_timestamps)
STREAM_TS = declared_formats(AsyncTextToSpeechClient.stream_with_timestamps)
EVERY = sorted({*CONVERT, *STREAM, *CONVERT_TS, *STREAM_TS})
DIALOGUE = {
    call: declared_formats(getattr(AsyncTextToDialogueClient, call))
    for call in ("convert", "stream", "convert_with_timestamps", "stream_with_timestamps")
}


class Decoded(typing.NamedTuple):
    rate: int
    seconds: float
    kbps: float
    """The coded stream's bit rate: its packets' bytes over its duration."""


def decode(data: bytes, fmt: str) -> Decoded:
    """``data`` decoded by PyAV as ``fmt`` says it is; asserts its container and codec."""
    codec, rate = fmt.split("_")[:2]
    if codec in RAW_FORMATS:
        opts = {"sample_rate": rate, "ch_layout": "mono"}
        c = av.open(io.BytesIO(data), format=RAW_FORMATS[codec], options=opts)
    else:
        c = av.open(io.BytesIO(data))
        container, codec_name = CONTAINERS[codec]
        assert container in c.format.name.split(","), (fmt, c.format.name)
        assert c.streams.audio[0].codec_context.name.startswith(codec_name), fmt
    with c:
        stream = c.streams.audio[0]
        samples, packet_bytes = 0, 0
        for packet in c.demux(stream):
            packet_bytes += packet.size
            for frame in packet.decode():
                samples += frame.samples
                got_rate = frame.sample_rate
        seconds = samples / got_rate
        return Decoded(got_rate, seconds, packet_bytes * 8 / 1000 / seconds)


def check(data: bytes, fmt: str, seconds: float = SECONDS) -> None:
    """``data`` decodes at ``fmt``'s rate, to ``seconds`` (the text's), at its bit rate."""
    codec, rate, *kbps = fmt.split("_")
    got = decode(data, fmt)
    assert got.rate == int(rate), (fmt, got)
    # mp3 adds its encoder delay and padding; Ogg Opus trims its pre-skip.
    slack = 0.15 if codec == "mp3" else 0.03
    assert seconds - 0.005 <= got.seconds < seconds + slack, (fmt, got)
    if codec == "mp3":  # constant bit rate: every frame at the named rate
        assert abs(got.kbps - int(kbps[0])) < 0.1 * int(kbps[0]), (fmt, got)
    if codec == "opus":  # variable: near the named rate (a steady tone)
        assert 0.5 * int(kbps[0]) < got.kbps < 1.2 * int(kbps[0]), (fmt, got)
    if codec == "wav":
        assert struct.unpack_from("<I", data, 24)[0] == int(rate), fmt


def wav_sizes(data: bytes) -> tuple[int, int]:
    return struct.unpack_from("<I", data, 4)[0], struct.unpack_from("<I", data, 40)[0]


def packets(data: bytes) -> list[bytes]:
    with av.open(io.BytesIO(data)) as c:
        return [bytes(p) for p in c.demux(audio=0) if p.size]


async def drain(it: Any) -> bytes:
    return b"".join([x async for x in it])


def client(h: Harness) -> AsyncElevenLabs:
    return AsyncElevenLabs(base_url=h.url, api_key="k")


def test_the_sdk_declares_the_formats_of_issue_58() -> None:
    """The SDK's lists hold the formats this issue is about (a newer SDK that dropped one
    would make the tests below pass without it)."""
    for name in ("opus_48000_32", "opus_48000_192", "pcm_32000", "wav_8000", "wav_48000"):
        assert name in CONVERT and name in CONVERT_TS, name
    assert "opus_48000_64" in STREAM and "pcm_32000" in STREAM and len(EVERY) == 28


async def test_convert_and_stream_answer_every_declared_format(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["k"]) as h:
        tts = client(h).text_to_speech
        for fmt in EVERY:
            whole = b""
            if fmt in CONVERT:
                whole = await drain(tts.convert("tara", text=TEXT, output_format=fmt))
                check(whole, fmt)
            if fmt in STREAM:
                streamed = await drain(tts.stream("tara", text=TEXT, output_format=fmt))
                check(streamed, fmt)
                if fmt.startswith("wav"):  # a stream's sizes are unknown: "max size"
                    assert wav_sizes(streamed) == (0xFFFFFFFF, 0xFFFFFFFF)
                    assert whole[44:] == streamed[44:] and wav_sizes(whole) == (
                        len(whole) - 8,
                        len(whole) - 44,
                    )
                elif fmt.startswith("opus"):  # each Ogg stream has a random serial number
                    assert packets(whole) == packets(streamed), fmt
                elif whole:
                    assert whole == streamed, fmt  # the same speaking, the same encoder
        assert h.gateway.active_streams == 0


async def test_with_timestamps_answer_every_declared_format(layout: InstanceLayout) -> None:
    async with running_gateway(layout, api_keys=["k"]) as h:
        tts = client(h).text_to_speech
        for fmt in CONVERT_TS:
            r = await tts.convert_with_timestamps("tara", text=TEXT, output_format=fmt)
            check(base64.b64decode(r.audio_base_64), fmt)
        for fmt in STREAM_TS:
            lines = [
                x async for x in tts.stream_with_timestamps("tara", text=TEXT, output_format=fmt)
            ]
            audio = b"".join(base64.b64decode(x.audio_base_64) for x in lines if x.audio_base_64)
            check(audio, fmt)


async def test_the_websocket_answers_every_declared_format(layout: InstanceLayout) -> None:
    """Each format on the multi-context socket: one context is one continuous stream (one
    WAV header, one Ogg stream), at the format's rate."""
    async with running_gateway(layout) as h, aiohttp.ClientSession() as s:
        for fmt in EVERY:
            url = f"{h.url}/v1/text-to-speech/tara/multi-stream-input?output_format={fmt}"
            audio = bytearray()
            async with s.ws_connect(url) as ws:
                await ws.send_json({"text": TEXT, "context_id": "c"})
                await ws.send_json({"context_id": "c", "flush": True})
                await ws.send_json({"context_id": "c", "close_context": True})
                while True:
                    m = json.loads((await ws.receive(20)).data)
                    assert "error" not in m, (fmt, m)
                    if m.get("isFinal"):
                        break
                    audio += base64.b64decode(m["audio"]) if m.get("audio") else b""
            check(bytes(audio), fmt)


async def test_text_to_dialogue_answers_every_declared_format(layout: InstanceLayout) -> None:
    """Two voices, one stream: each of its four calls in each format it declares."""
    turns = [{"text": "Hello world.", "voice_id": "tara"}, {"text": "Bye now.", "voice_id": "leah"}]
    async with running_gateway(layout, api_keys=["k"]) as h:
        dialogue = client(h).text_to_dialogue
        pcm = await drain(dialogue.convert(inputs=turns, output_format="pcm_24000"))
        seconds = len(pcm) / 48000  # the turns and the pause between them
        for call, formats in DIALOGUE.items():
            for fmt in formats:
                got = getattr(dialogue, call)(inputs=turns, output_format=fmt)
                if call == "convert_with_timestamps":
                    audio = base64.b64decode((await got).audio_base_64)
                elif call == "stream_with_timestamps":
                    audio = b"".join(
                        [base64.b64decode(x.audio_base_64) async for x in got if x.audio_base_64]
                    )
                else:
                    audio = await drain(got)
                check(audio, fmt, seconds)
                if fmt.startswith("wav") and call == "convert_with_timestamps":
                    assert wav_sizes(audio) == (len(audio) - 8, len(audio) - 44)


async def test_an_unknown_format_is_a_400_naming_the_accepted_ones(
    layout: InstanceLayout,
) -> None:
    async with running_gateway(layout, api_keys=["k"]) as h:
        tts = client(h).text_to_speech
        with pytest.raises(ApiError) as e:
            await drain(tts.convert("tara", text=TEXT, output_format="flac_44100"))
        assert e.value.status_code == 400
        err = e.value.body["error"]
        assert err["code"] == "invalid_output_format" and err["param"] == "output_format"
        for name in EVERY:
            assert name in err["message"], name


def test_declared_formats_reads_nested_literals() -> None:
    """The helper finds a Literal under Optional and Union, and only there."""

    def f(output_format: typing.Optional[typing.Union[typing.Literal["a", "b"], Any]]) -> None:  # noqa: UP007, UP045
        pass

    assert declared_formats(f) == ["a", "b"]
