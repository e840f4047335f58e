"""Streaming audio encoders: 24 kHz int16 mono PCM in, the response format's bytes out.

``pcm`` and ``wav`` pass the samples through (WAV after one header). The compressed formats
go through PyAV (FFmpeg) with a muxer that flushes every packet, so each chunk's bytes
leave as soon as the codec has produced them. A codec with a fixed frame size (mp3 576,
aac 1024, opus 480 samples at 24 kHz) holds back the remainder of a chunk until the next
one; ``finish`` drains it. Lossy codecs add their own priming/padding (mp3 and aac decode
a few hundred to ~2000 samples longer than the input; ogg/opus trims its pre-skip).

``speed`` other than 1.0 is applied with FFmpeg's ``atempo`` filter (pitch-preserving
time-stretch): the model itself has no speed control. The filter holds back one chunk.

G.711 is a per-sample table lookup: the tables are made once by FFmpeg's own ``pcm_mulaw``
and ``pcm_alaw`` encoders (so they match every decoder), then applied with numpy.
"""

from __future__ import annotations

import functools
import struct
from fractions import Fraction
from typing import Final, Protocol

import av
import numpy as np

from gateway.audio.formats import CODECS, G711, Codec
from shm.records import PCM_DTYPE, SAMPLE_RATE

ENCODER_FORMATS: Final[tuple[Codec, ...]] = tuple(c for c in CODECS if c not in G711)
"""The formats with an encoder of their own at 24 kHz (``gateway.audio.output.make_output``
makes every encoder; G.711 and other rates chain a resampler before one of these)."""

# format -> (muxer, codec, codec options, muxer options). Speech-grade bit rates; encoder
# effort chosen for CPU per stream (the defaults cost 2-4x more for no audible gain on speech).
_CONTAINERS: dict[str, tuple[str, str, dict[str, str], dict[str, str]]] = {
    "mp3": ("mp3", "libmp3lame", {"b": "64k", "compression_level": "7"}, {}),
    "aac": ("adts", "aac", {"b": "64k", "aac_coder": "fast"}, {}),
    "opus": (
        "ogg",
        "libopus",
        {"b": "48k", "application": "voip", "compression_level": "5"},
        {"page_duration": "20000"},  # one Ogg page per 20 ms packet: no muxer-side delay
    ),
    "flac": ("flac", "flac", {"frame_size": "2048"}, {}),
}
_TIME_BASE = Fraction(1, SAMPLE_RATE)
_MAX_DATA_SIZE = 0xFFFFFFFF


def wav_header(sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 16-bit mono WAV header for a stream of unknown length.

    The RIFF and data sizes are 0xFFFFFFFF (the "max size" convention of streaming WAV):
    readers that trust them read until the end of the stream.
    """
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", _MAX_DATA_SIZE)
        + b"WAVEfmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", _MAX_DATA_SIZE)
    )


def wav_sized(data: bytes | bytearray) -> bytes:
    """A whole WAV file (``wav_header``'s 44 bytes, then its samples) with its real RIFF and
    data sizes in place of the streaming 0xFFFFFFFF: what a file answered at once carries."""
    out = bytearray(data)
    struct.pack_into("<I", out, 4, len(out) - 8)
    struct.pack_into("<I", out, 40, len(out) - 44)
    return bytes(out)


class AudioEncoder(Protocol):
    def encode(self, pcm: bytes) -> bytes:
        """Bytes to send for one chunk of PCM (may be empty while a codec fills a frame)."""
        ...

    def finish(self) -> bytes:
        """The tail held back by the codec; call once at the end of the stream."""
        ...

    def close(self) -> None:
        """Release codec state; safe after ``finish`` and on error paths."""
        ...


class PcmEncoder:
    def encode(self, pcm: bytes) -> bytes:
        return pcm

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


class WavEncoder:
    """PCM after one header (at ``sample_rate``, the rate of the PCM it is given)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE) -> None:
        self._header: bytes | None = wav_header(sample_rate)

    def encode(self, pcm: bytes) -> bytes:
        if self._header is None:
            return pcm
        out, self._header = self._header + pcm, None
        return out

    def finish(self) -> bytes:
        out, self._header = (self._header or b""), None  # an empty stream is still a WAV file
        return out

    def close(self) -> None:
        pass


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
    """int16 PCM (at 8 kHz) to G.711 (mu-law or A-law), one byte per sample."""

    def __init__(self, law: str) -> None:
        self._table = g711_table(law)

    def encode(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype=PCM_DTYPE).astype(np.int32) + 32768
        return self._table[samples].tobytes()

    def finish(self) -> bytes:
        return b""

    def close(self) -> None:
        pass


def pcm_frame(pcm: bytes, pts: int, rate: int = SAMPLE_RATE) -> av.AudioFrame:
    frame = av.AudioFrame.from_ndarray(
        np.frombuffer(pcm, dtype=PCM_DTYPE).reshape(1, -1), format="s16", layout="mono"
    )
    frame.sample_rate = rate
    frame.time_base = _TIME_BASE if rate == SAMPLE_RATE else Fraction(1, rate)
    frame.pts = pts
    return frame


class _ByteSink:
    """The file object PyAV's muxer writes to; the encoder collects what each chunk wrote."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        parts = self._parts
        if not parts:
            return b""
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        return out


class ContainerEncoder:
    """mp3 / aac (ADTS) / opus (Ogg) / flac through PyAV, flushed after every packet.

    ``rate`` is the sample rate of the PCM given to ``encode`` (and of the encoded stream);
    ``bitrate`` overrides the format's default (e.g. "32k").
    """

    def __init__(self, fmt: str, rate: int = SAMPLE_RATE, bitrate: str | None = None) -> None:
        muxer, codec, codec_opts, mux_opts = _CONTAINERS[fmt]
        if bitrate is not None:
            codec_opts = {**codec_opts, "b": bitrate}
        self._sink = _ByteSink()
        self._container = av.open(
            self._sink, "w", format=muxer, options={"flush_packets": "1", **mux_opts}
        )
        self._stream = self._container.add_stream(
            codec, rate=rate, layout="mono", options=codec_opts
        )
        self._rate = rate
        self._pts = 0
        self._closed = False

    def encode_frame(self, frame: av.AudioFrame | None) -> bytes:
        mux = self._container.mux
        for packet in self._stream.encode(frame):
            mux(packet)
        return self._sink.take()

    def encode(self, pcm: bytes) -> bytes:
        if not pcm:
            return b""
        frame = pcm_frame(pcm, self._pts, self._rate)
        self._pts += frame.samples
        return self.encode_frame(frame)

    def finish(self) -> bytes:
        out = self.encode_frame(None)
        self._container.close()
        self._closed = True
        return out + self._sink.take()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self._container.close()
            except (av.FFmpegError, ValueError):
                pass  # abandoning a half-written stream: nothing to salvage


def tempo_factors(speed: float) -> list[float]:
    """atempo factors whose product is ``speed``, each within the filter's [0.5, 100]."""
    factors: list[float] = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    factors.append(speed)
    return factors


class TempoEncoder:
    """Time-stretches by ``speed`` (pitch kept) with FFmpeg's atempo, then encodes."""

    def __init__(self, fmt: str, speed: float) -> None:
        graph = av.filter.Graph()
        node = graph.add_abuffer(
            format="s16", sample_rate=SAMPLE_RATE, layout="mono", time_base=_TIME_BASE
        )
        self._src = node
        for factor in tempo_factors(speed):
            nxt = graph.add("atempo", f"{factor:.6f}")
            node.link_to(nxt)
            node = nxt
        sink = graph.add("abuffersink")
        node.link_to(sink)
        graph.configure()
        self._graph = graph
        self._pts = 0
        self._container = ContainerEncoder(fmt) if fmt in _CONTAINERS else None
        self._wav_header: bytes | None = wav_header() if fmt == "wav" else None

    def _drain(self) -> bytes:
        parts: list[bytes] = []
        if self._wav_header is not None:
            parts.append(self._wav_header)
            self._wav_header = None
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                break
            if self._container is not None:
                parts.append(self._container.encode_frame(frame))
            else:
                parts.append(frame.to_ndarray().tobytes())
        return b"".join(parts)

    def encode(self, pcm: bytes) -> bytes:
        if not pcm:
            return b""
        frame = pcm_frame(pcm, self._pts)
        self._pts += frame.samples
        self._graph.push(frame)
        return self._drain()

    def finish(self) -> bytes:
        self._graph.push(None)
        out = self._drain()
        if self._container is not None:
            out += self._container.finish()
        return out

    def close(self) -> None:
        if self._container is not None:
            self._container.close()
