"""PerTh's spectrogram at 24 kHz, without resampling to its 32 kHz.

PerTh reads and marks a normalised log-magnitude STFT at 32 kHz: n_fft = window = 2048
(64 ms, hann), hop 320 (10 ms), bins 15.625 Hz apart. At 24 kHz an STFT with n_fft = window
= 1536 and hop 240 has the same window duration, hop and bin frequencies: for audio below
12 kHz (all of ours), its bin k is the 32 kHz bin k scaled by 24/32 (the same integral,
sampled with 3/4 the samples), and the 32 kHz bins above 12 kHz hold nothing. So the
network's input is computed here at 24 kHz, and the watermark's change to the magnitudes
goes back through the inverse STFT at 24 kHz: no resampling of the audio in either
direction, and the samples leave unchanged but for the mark (``marked = x + delta``).

The normalisation is PerTh's (``perth_net_implicit/utils.py``): ``20 log10(max(|X|, 1e-9))``
mapped from [-180, +15] dB onto [0, 1].
"""

from __future__ import annotations

import math

import torch

SAMPLE_RATE = 24_000
PERTH_RATE = 32_000
N_FFT = 1536
"""2048 at 32 kHz: 64 ms."""
HOP = 240
"""320 at 32 kHz: 10 ms."""
BINS = N_FFT // 2 + 1
"""769: the 32 kHz spectrum's bins up to 12 kHz."""
PERTH_BINS = 2048 // 2 + 1
MAGNITUDE_SCALE = PERTH_RATE / SAMPLE_RATE
"""|X_32k[k]| = 4/3 |X_24k[k]| for the same window duration."""
HEADROOM_DB = 15.0


class Spectral:
    """The STFT, its inverse and PerTh's normalisation on one device (window preallocated)."""

    def __init__(self, magnitude_min: float, device: torch.device) -> None:
        self.window = torch.hann_window(N_FFT, device=device)
        self.min_db = 20.0 * math.log10(magnitude_min)
        self.span_db = -self.min_db + HEADROOM_DB
        self.magnitude_min = magnitude_min / MAGNITUDE_SCALE
        """The floor of |X_24k| that is 1e-9 at 32 kHz."""

    def stft(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L)`` audio -> ``(B, 769, L // 240 + 1)`` complex, centred with reflection
        (torchaudio's ``Spectrogram``, as PerTh uses it)."""
        return torch.stft(
            x, N_FFT, HOP, N_FFT, self.window, center=True, pad_mode="reflect",
            normalized=False, onesided=True, return_complex=True,
        )  # fmt: skip

    def istft(self, spec: torch.Tensor, length: int) -> torch.Tensor:
        return torch.istft(
            spec, N_FFT, HOP, N_FFT, self.window, center=True, normalized=False,
            onesided=True, length=length,
        )  # fmt: skip

    def normalised(self, spec: torch.Tensor) -> torch.Tensor:
        """PerTh's input from a 24 kHz spectrum: ``(B, 769, T)`` in [0, 1]."""
        mag = spec.abs().clamp_(min=self.magnitude_min).mul_(MAGNITUDE_SCALE)
        return mag.log10_().mul_(20.0).sub_(self.min_db).div_(self.span_db)

    def gain(self, residual: torch.Tensor) -> torch.Tensor:
        """A residual in normalised units -> the linear magnitude factor it applies."""
        return torch.pow(10.0, residual * (self.span_db / 20.0))
