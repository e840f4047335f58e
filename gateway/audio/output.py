"""Audio in the formats the voice-agent and telephony clients ask for.

The model speaks 24 kHz int16 mono. A client may want another rate (``pcm_16000``, a phone
bridge at 8 kHz), G.711 (``ulaw_8000``, ``alaw_8000``) or MP3 at a given rate and bit rate
(``mp3_22050_32``). An ``OutputFormat`` names what is sent; ``make_output`` builds one
streaming encoder for it: optional time-stretch (``speed``), then PyAV's resampler
(``av.AudioResampler``, FFmpeg's swresample), then the codec. One encoder serves one
continuous stream: an ElevenLabs context or an utterance of a session is one MP3 stream,
not a file per sentence.

G.711 is a per-sample table lookup: the tables are made once by FFmpeg's own ``pcm_mulaw``
and ``pcm_alaw`` encoders (so they match every decoder), then applied with numpy.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import Literal

import av
import msgspec
import numpy as np

from gateway.audio.encoders import (
    AudioEncoder,
    ContainerEncoder,
    PcmEncoder,
    TempoEncoder,
    WavEncoder,
    make_encoder,
    wav_header,
)
from shm.records import PCM_DTYPE, SAMPLE_RATE

Codec = Literal["pcm", "wav", "mp3", "opus", "aac", "flac", "ulaw", "alaw"]
SAMPLE_RATES = (8000, 16000, 22050, 24000, 44100, 48000)

CONTENT_TYPES: dict[Codec, str] = {
    "pcm": "audio/pcm",
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "opus": "audio/opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "ulaw": "audio/basic",
    "alaw": "audio/x-alaw-basic",
}


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
        if self.codec in ("ulaw", "alaw"):
            return self.sample_rate
        return None


# ElevenLabs' output_format names (the ones this server produces).
ELEVENLABS_FORMATS: dict[str, OutputFormat] = {
    "pcm_8000": OutputFormat("pcm", 8000),
    "pcm_16000": OutputFormat("pcm", 16000),
    "pcm_22050": OutputFormat("pcm", 22050),
    "pcm_24000": OutputFormat("pcm", 24000),
    "pcm_44100": OutputFormat("pcm", 44100),
    "pcm_48000": OutputFormat("pcm", 48000),
    "ulaw_8000": OutputFormat("ulaw", 8000),
    "alaw_8000": OutputFormat("alaw", 8000),
    "mp3_22050_32": OutputFormat("mp3", 22050, "32k"),
    "mp3_24000_48": OutputFormat("mp3", 24000, "48k"),
    "mp3_44100_32": OutputFormat("mp3", 44100, "32k"),
    "mp3_44100_64": OutputFormat("mp3", 44100, "64k"),
    "mp3_44100_96": OutputFormat("mp3", 44100, "96k"),
    "mp3_44100_128": OutputFormat("mp3", 44100, "128k"),
    "mp3_44100_192": OutputFormat("mp3", 44100, "192k"),
}


@functools.cache
def g711_table(law: str) -> np.ndarray:
    """uint8 code of every int16 sample (index: sample + 32768), made by FFmpeg's encoder."""
    codec = {"ulaw": "pcm_mulaw", "alaw": "pcm_alaw"}[law]
    ctx = av.CodecContext.create(codec, "w")
    ctx.sample_rate = 8000
    ctx.layout = "mono"
    ctx.format = "s16"
    samples = np.arange(-32768, 32768, dtype=np.int16).reshape(1, -1)
    frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
    frame.sample_rate = 8000
    frame.pts = 0
    data = b"".join(bytes(p) for p in [*ctx.encode(frame), *ctx.encode(None)])
    table = np.frombuffer(data, dtype=np.uint8)
    if table.size != 65536:
        raise RuntimeError(f"{codec} encoded {table.size} bytes for 65536 samples")
    return table


class G711Encoder:
    """int16 PCM to G.711 (mu-law or A-law), one byte per sample."""

    def __init__(self, law: str) -> None:
        self._table = g711_table(law)

    def encode(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype=PCM_DTYPE).astype(np.int32) + 32768
        return self._table[samples].tobytes()

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


class Resampler:
    """24 kHz int16 mono to ``rate`` with FFmpeg's swresample, as a stream."""

    def __init__(self, rate: int, in_rate: int = SAMPLE_RATE) -> None:
        self._in_rate = in_rate
        self._time_base = Fraction(1, in_rate)
        self._resampler = av.AudioResampler(format="s16", layout="mono", rate=rate)
        self._pts = 0

    def _convert(self, frame: av.AudioFrame | None) -> bytes:
        out = self._resampler.resample(frame)
        if not out:
            return b""
        return b"".join(f.to_ndarray().tobytes() for f in out)

    def encode(self, pcm: bytes) -> bytes:
        if not pcm:
            return b""
        samples = np.frombuffer(pcm, dtype=PCM_DTYPE).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
        frame.sample_rate = self._in_rate
        frame.time_base = self._time_base
        frame.pts = self._pts
        self._pts += samples.shape[1]
        return self._convert(frame)

    def finish(self) -> bytes:
        return self._convert(None)

    def close(self) -> None:
        pass


class ChainEncoder:
    """``second(first(pcm))``: e.g. resample, then encode."""

    def __init__(self, first: AudioEncoder, second: AudioEncoder) -> None:
        self._first = first
        self._second = second

    def encode(self, pcm: bytes) -> bytes:
        mid = self._first.encode(pcm)
        return self._second.encode(mid) if mid else b""

    def finish(self) -> bytes:
        mid = self._first.finish()
        out = self._second.encode(mid) if mid else b""
        return out + self._second.finish()

    def close(self) -> None:
        self._first.close()
        self._second.close()


class _RateWavEncoder(WavEncoder):
    def __init__(self, rate: int) -> None:
        super().__init__()
        self._header = wav_header(rate)


def _codec_encoder(fmt: OutputFormat) -> AudioEncoder:
    """The encoder of PCM already at ``fmt.sample_rate``."""
    if fmt.codec == "pcm":
        return PcmEncoder()
    if fmt.codec == "wav":
        return _RateWavEncoder(fmt.sample_rate)
    if fmt.codec in ("ulaw", "alaw"):
        return G711Encoder(fmt.codec)
    return ContainerEncoder(fmt.codec, fmt.sample_rate, fmt.bitrate)


def check_format(fmt: OutputFormat) -> None:
    """ValueError if this server cannot produce ``fmt``."""
    if fmt.sample_rate not in SAMPLE_RATES:
        raise ValueError(
            f"sample rate {fmt.sample_rate} is not one of {', '.join(map(str, SAMPLE_RATES))}"
        )
    if fmt.codec in ("ulaw", "alaw") and fmt.sample_rate != 8000:
        raise ValueError(f"{fmt.codec} is 8000 Hz only")
    if fmt.codec == "opus" and fmt.sample_rate not in (8000, 16000, 24000, 48000):
        raise ValueError("opus takes 8000, 16000, 24000 or 48000 Hz")
    if fmt.codec == "mp3" and fmt.sample_rate == 8000 and fmt.bitrate is None:
        pass  # MPEG-2.5 at 8 kHz: libmp3lame picks a fitting default


def make_output(fmt: OutputFormat, speed: float = 1.0) -> AudioEncoder:
    """A streaming encoder from 24 kHz int16 mono PCM to ``fmt`` (time-stretched by
    ``speed``). For the formats the OpenAI API always had, at 24 kHz, this is
    ``gateway.audio.encoders.make_encoder``'s encoder, unchanged."""
    check_format(fmt)
    if fmt.sample_rate == SAMPLE_RATE and fmt.bitrate is None and fmt.codec not in ("ulaw", "alaw"):
        return make_encoder(fmt.codec, speed)
    enc = _codec_encoder(fmt)
    if fmt.sample_rate != SAMPLE_RATE:
        enc = ChainEncoder(Resampler(fmt.sample_rate), enc)
    if speed != 1.0:
        enc = ChainEncoder(TempoEncoder("pcm", speed), enc)
    return enc
