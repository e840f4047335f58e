"""The audio formats the gateway sends, stated once: codecs, sample rates, content types, and
which codec may be sent at which rate.

The model speaks 24 kHz int16 mono. A client may want another rate (``pcm_16000``, a phone
bridge at 8 kHz), G.711 (``ulaw_8000``, ``alaw_8000``) or MP3 at a given rate and bit rate
(``mp3_22050_32``), Ogg Opus (``opus_48000_64``) or a WAV file (``wav_16000``). An ``OutputFormat`` names what is sent; ``gateway.audio.output`` builds
its encoder. Request validation (``gateway.schemas``) takes its literals from here.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

import msgspec

from shm.records import SAMPLE_RATE

Codec = Literal["pcm", "wav", "mp3", "opus", "aac", "flac", "ulaw", "alaw"]
"""Every codec the gateway sends (OpenAI's ``response_format`` plus G.711)."""
SampleRate = Literal[8000, 16000, 22050, 24000, 32000, 44100, 48000]
"""Every rate the gateway resamples to (the model's own: ``shm.records.SAMPLE_RATE``)."""

CODECS: Final[tuple[Codec, ...]] = get_args(Codec)
SAMPLE_RATES: Final[tuple[int, ...]] = get_args(SampleRate)
G711: Final[frozenset[Codec]] = frozenset({"ulaw", "alaw"})
"""8 kHz only, one byte per sample."""
RAW: Final[frozenset[Codec]] = frozenset({"pcm"}) | G711
"""Headerless, one fixed-size sample after another: a stream may be cut at any sample."""
OPUS_RATES: Final[tuple[int, ...]] = (8000, 16000, 24000, 48000)

CONTENT_TYPES: Final[dict[Codec, str]] = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
}


def default_rate(codec: Codec) -> int:
    """The rate a request that names none gets: the model's, 8000 for G.711."""
    return 8000 if codec in G711 else SAMPLE_RATE


class OutputFormat(msgspec.Struct, frozen=True):
    """What a client receives: codec, sample rate, and a bit rate for lossy codecs."""

    codec: Codec = "pcm"
    sample_rate: int = SAMPLE_RATE
    bitrate: str | None = None
    """e.g. "32k" (mp3); None: the codec's default in ``gateway.audio.encoders``."""

    @property
    def content_type(self) -> str:
        return CONTENT_TYPES[self.codec]

    @property
    def bytes_per_second(self) -> int | None:
        """For the raw formats: bytes per second of audio; None for coded ones."""
        if self.codec == "pcm":
            return self.sample_rate * 2
        if self.codec in G711:
            return self.sample_rate
        return None


def check_format(fmt: OutputFormat) -> None:
    """ValueError if this server cannot produce ``fmt``."""
    if fmt.sample_rate not in SAMPLE_RATES:
        raise ValueError(
            f"sample rate {fmt.sample_rate} is not one of {', '.join(map(str, SAMPLE_RATES))}"
        )
    if fmt.codec in G711 and fmt.sample_rate != 8000:
        raise ValueError(f"{fmt.codec} is 8000 Hz only")
    if fmt.codec == "opus" and fmt.sample_rate not in OPUS_RATES:
        *most, last = OPUS_RATES
        raise ValueError(f"opus takes {', '.join(map(str, most))} or {last} Hz")
    # mp3 at 8 kHz is MPEG-2.5: libmp3lame picks a fitting default bit rate.


ELEVENLABS_CODECS: Final[dict[str, Codec]] = {
    "pcm": "pcm",
    "wav": "wav",
    "ulaw": "ulaw",
    "alaw": "alaw",
    "mp3": "mp3",
    "opus": "opus",
}
"""ElevenLabs' codec names: ``{codec}_{rate}`` or, for lossy ones, ``{codec}_{rate}_{kbps}``."""


def _elevenlabs(name: str) -> OutputFormat:
    codec, rate, *kbps = name.split("_")
    return OutputFormat(ELEVENLABS_CODECS[codec], int(rate), f"{kbps[0]}k" if kbps else None)


# ElevenLabs' output_format names: every one its SDK (2.78) declares for text-to-speech
# (tests/gateway/frontends/elevenlabs/test_elevenlabs_formats.py iterates the SDK's own list).
ELEVENLABS_FORMATS: Final[dict[str, OutputFormat]] = {
    name: _elevenlabs(name)
    for name in (
        *(f"pcm_{r}" for r in (8000, 16000, 22050, 24000, 32000, 44100, 48000)),
        *(f"wav_{r}" for r in (8000, 16000, 22050, 24000, 32000, 44100, 48000)),
        "ulaw_8000",
        "alaw_8000",
        "mp3_22050_32",
        "mp3_24000_48",
        *(f"mp3_44100_{k}" for k in (32, 64, 96, 128, 192)),
        *(f"opus_48000_{k}" for k in (32, 64, 96, 128, 192)),
    )
}
