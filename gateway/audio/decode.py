"""Any audio file PyAV (FFmpeg) reads, decoded to float32 mono at 24 kHz: what the watermark
detector reads (``POST /v1/watermark/detect`` and ``orpheus-serve watermark detect``)."""

from __future__ import annotations

import io
from typing import IO

import av
import numpy as np

SAMPLE_RATE = 24_000
MAX_CHANNELS = 8


class UnreadableAudio(ValueError):
    """The bytes are not audio FFmpeg can decode, or are too long; the message says which."""


def decode_clip(data: bytes | IO[bytes], max_seconds: float) -> tuple[np.ndarray, int]:
    """(float32 mono 24 kHz samples, the file's own sample rate). Raw G.711 and other
    headerless formats are not guessed: send them in a container (WAV)."""
    try:
        container = av.open(io.BytesIO(data) if isinstance(data, bytes) else data, mode="r")
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise UnreadableAudio(f"not an audio file FFmpeg can read ({e})") from None
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    n = 0
    with container:
        if not container.streams.audio:
            raise UnreadableAudio("the file has no audio stream")
        stream = container.streams.audio[0]
        rate = stream.codec_context.sample_rate or 0
        if (stream.codec_context.channels or 0) > MAX_CHANNELS:
            raise UnreadableAudio(f"more than {MAX_CHANNELS} channels")
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    n += chunks[-1].size
                if n > limit:
                    raise UnreadableAudio(f"longer than {max_seconds:g} s")
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
                n += chunks[-1].size
        except (av.error.FFmpegError, ValueError) as e:
            if isinstance(e, UnreadableAudio):
                raise
            raise UnreadableAudio(f"undecodable ({e})") from None
    if not n:
        raise UnreadableAudio("the file holds no samples")
    pcm = np.concatenate(chunks).astype(np.float32, copy=False)
    if not np.isfinite(pcm).all():
        raise UnreadableAudio("the audio holds NaN or infinite samples")
    return np.clip(pcm, -1.0, 1.0, out=pcm), rate
