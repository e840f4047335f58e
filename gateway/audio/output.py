"""The output pipeline: one streaming encoder from the model's 24 kHz int16 mono PCM to an
``OutputFormat`` (``gateway.audio.formats``).

``make_output`` chains the stages a format needs: optional time-stretch (``speed``), then
PyAV's resampler (``av.AudioResampler``, FFmpeg's swresample), then the codec
(``gateway.audio.encoders``). One encoder serves one continuous stream: an ElevenLabs
context or an utterance of a session is one MP3 stream, not a file per sentence.
"""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np

from gateway.audio.encoders import (
    AudioEncoder,
    ContainerEncoder,
    G711Encoder,
    PcmEncoder,
    TempoEncoder,
    WavEncoder,
)
from gateway.audio.formats import G711, OutputFormat, check_format
from shm.records import PCM_DTYPE, SAMPLE_RATE


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


def _codec_encoder(fmt: OutputFormat) -> AudioEncoder:
    """The encoder of PCM already at ``fmt.sample_rate``."""
    if fmt.codec == "pcm":
        return PcmEncoder()
    if fmt.codec == "wav":
        return WavEncoder(fmt.sample_rate)
    if fmt.codec in G711:
        return G711Encoder(fmt.codec)
    return ContainerEncoder(fmt.codec, fmt.sample_rate, fmt.bitrate)


def make_output(fmt: OutputFormat, speed: float = 1.0) -> AudioEncoder:
    """The one factory of the gateway's encoders: a streaming encoder from 24 kHz int16 mono
    PCM to ``fmt`` (time-stretched by ``speed``). The 24 kHz formats the OpenAI API always
    had stretch straight into their container (``TempoEncoder``); any other rate or G.711
    resamples first, and stretches before that."""
    check_format(fmt)
    if fmt.sample_rate == SAMPLE_RATE and fmt.bitrate is None and fmt.codec not in G711:
        return TempoEncoder(fmt.codec, speed) if speed != 1.0 else _codec_encoder(fmt)
    enc = _codec_encoder(fmt)
    if fmt.sample_rate != SAMPLE_RATE:
        enc = ChainEncoder(Resampler(fmt.sample_rate), enc)
    if speed != 1.0:
        enc = ChainEncoder(TempoEncoder("pcm", speed), enc)
    return enc
