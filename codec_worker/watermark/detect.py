"""Reading a whole clip's watermark for ``DetectRequest`` (``POST /v1/watermark/detect``), on
the encode server's thread (``codec_worker.encoder``), beside the decode loop.

With ``codec.watermark=off`` the server marks nothing but still answers: PerTh is loaded on
the first request (a platform checking uploads needs the detector, not the marking).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from codec_worker.watermark import StreamWatermark, load_watermark

MAX_SECONDS = 120.0
"""Nothing longer is read, whatever a client of the socket sends (the gateway cuts first)."""
SAMPLE_RATE = 24_000


class ClipDetector:
    def __init__(self, watermark: StreamWatermark | None, device: torch.device) -> None:
        self.device = device
        self._watermark = watermark
        self._lock = threading.Lock()
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _loaded(self) -> StreamWatermark:
        with self._lock:
            if self._watermark is None:
                watermark = load_watermark("perth", self.device)
                assert watermark is not None
                self._watermark = watermark
            return self._watermark

    def detect(self, pcm: np.ndarray) -> tuple[float, str]:
        """``pcm`` float32 mono 24 kHz -> (confidence in [0, 1] that it is marked, the
        watermark's name)."""
        if pcm.ndim != 1 or len(pcm) < SAMPLE_RATE // 50:
            raise ValueError("expected a mono clip of at least 20 ms")
        if len(pcm) > MAX_SECONDS * SAMPLE_RATE:
            raise ValueError(f"clip of {len(pcm)} samples: at most {MAX_SECONDS:g} s")
        watermark = self._loaded()
        x = torch.from_numpy(np.array(pcm, dtype=np.float32))  # a writable copy
        if self._stream is None:
            return watermark.score(x), watermark.name
        with torch.cuda.stream(self._stream):
            # score's float() waits for this stream: the reply needs the number.
            return watermark.score(x.to(self.device, non_blocking=True)), watermark.name
