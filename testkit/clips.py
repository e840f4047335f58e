"""Reference clips for custom voices, as a client would upload them (``bench voices`` and
the voice tests): 16-bit PCM WAV, and a voice-like tone (an amplitude-modulated sine)."""

from __future__ import annotations

import io
import wave

import numpy as np


def wav_bytes(x: np.ndarray, rate: int) -> bytes:
    """A WAV file of samples in [-1, 1] (clipped): ``(n,)`` mono or ``(n, channels)``."""
    x = np.asarray(x)
    if x.ndim == 1:
        x = x[:, None]
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(x, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def reference_clip(seconds: float = 3.5, rate: int = 24_000, f0: float = 180.0) -> bytes:
    """``seconds`` of a tone at ``f0`` Hz whose loudness swells 2.5 times a second, as WAV."""
    t = np.arange(int(seconds * rate)) / rate
    return wav_bytes(
        0.3 * np.sin(2 * np.pi * f0 * t) * (1 + 0.5 * np.sin(2 * np.pi * 2.5 * t)), rate
    )
