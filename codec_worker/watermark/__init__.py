"""The watermark every chunk of audio carries, applied in the codec worker after decoding.

``StreamWatermark`` is what the decode engine needs of a watermark: per-stream state (a
slot of past audio), one batched marking per decode group, and a clip's score for the
detector. PerTh is the one kind now; another (e.g. AudioSeal's streaming generator, its
weights given by path) implements the same protocol and gets a name in the loader here.

Modules: ``perth`` (``PerthWatermark``: streamed, batched marking and the clip's reading),
``perth_model`` (PerTh's network and checkpoint from the resemble-perth package, without its
librosa/torchaudio wrapper), ``spectral`` (PerTh's spectrogram computed at 24 kHz), ``detect`` (``ClipDetector``: a whole
clip's reading for ``DetectRequest``).
"""

from __future__ import annotations

from typing import Protocol

import torch

from codec_worker.watermark.perth_model import WatermarkUnavailable

__all__ = ["StreamWatermark", "WatermarkUnavailable", "load_watermark"]


class StreamWatermark(Protocol):
    name: str
    context: int
    """Samples of a stream's past audio each chunk is marked with."""

    def acquire(self) -> int:
        """A slot for a new stream's state (> 0)."""

    def release(self, slot: int) -> None:
        """The stream ended: its slot may be reused."""

    def mark(self, audio: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """Marked copies of ``audio (n, N)`` float 24 kHz, the next chunk of the streams at
        ``slots (n,)``; ``fresh (n,)`` bool: a stream's first chunk."""

    def score(self, audio: torch.Tensor) -> float:
        """Confidence in [0, 1] that a 24 kHz mono clip ``(L,)`` carries the mark."""


def load_watermark(kind: str, device: torch.device) -> StreamWatermark | None:
    """The configured watermark on ``device`` (None for ``off``); raises
    ``WatermarkUnavailable`` (a permanent start-up failure) if it cannot load."""
    if kind == "off":
        return None
    if kind == "perth":
        from codec_worker.watermark.perth import PerthWatermark

        return PerthWatermark(device)
    raise WatermarkUnavailable(f"unknown watermark {kind!r} (perth or off)")
