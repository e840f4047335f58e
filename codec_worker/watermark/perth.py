"""PerTh marking of streamed chunks, batched across streams, and PerTh's reading of a clip.

Marking a chunk: PerTh's encoder turns the normalised magnitudes of the chunk's 128 bins
below 2 kHz into a residual (masked to frames that are not silent); the mark is that
residual's change to the spectrum, taken back to samples by the inverse STFT
(``marked = x + istft(X * (gain - 1))``; ``spectral.py``: everything at 24 kHz).

Streaming: a chunk is marked together with ``CONTEXT`` samples of the stream's past
(unmarked) audio before it, kept per stream in a preallocated tail pool on the device, and
nothing is held back: the future the encoder's convolutions would read past the chunk's end
(31 STFT frames wide, 15 = 150 ms to the right) does not exist yet, so the chunk's last
``AHEAD`` samples, mirrored, stand in for it (speech and the codec's noise are locally
stationary; the mirror keeps the spectral envelope the encoder reads). Measured on the random
SNAC's audio, one-frame (2,048-sample) chunks against one pass over the utterance: -24 dB
without the mirror, -35 dB with it (100 ms); the left context matters less (-34.5 dB from
50 ms to 200 ms). A stream's first chunk is marked with silence before it. The streams of
one decode group (same chunk length) are marked in one batched pass.
"""

from __future__ import annotations

import torch

from codec_worker.watermark.perth_model import PerthParts, load_perth
from codec_worker.watermark.spectral import BINS, HOP, SAMPLE_RATE, Spectral

CONTEXT = 10 * HOP
"""Past samples a chunk is marked with: 2,400 (100 ms, 10 STFT hops)."""
AHEAD = 10 * HOP
"""Mirrored samples after a chunk's end, standing in for the future: 2,400 (100 ms)."""
MIN_SLOTS = 64


class PerthWatermark:
    """Marks streamed chunks and scores clips with PerTh's trained network on ``device``."""

    name = "perth"
    context = CONTEXT

    def __init__(self, device: torch.device, parts: PerthParts | None = None) -> None:
        self.device = device
        self.parts = parts if parts is not None else load_perth(device)
        self.spectral = Spectral(self.parts.hp.stft_magnitude_min, device)
        self.subband = self.parts.subband
        if self.parts.hp.n_fft * SAMPLE_RATE != 1536 * self.parts.hp.sample_rate:
            raise ValueError(f"PerTh hyperparameters {self.parts.hp} do not tile 24 kHz")
        self._tails = torch.zeros((MIN_SLOTS + 1, CONTEXT), device=device)
        """Row 0: scratch (warm-up, no stream); rows 1..: one per stream, its last samples."""
        self._free = list(range(MIN_SLOTS, 0, -1))

    # -- per-stream tails -----------------------------------------------------------------------
    def acquire(self) -> int:
        """A tail slot for a new stream (its first chunk ignores what the slot held)."""
        if not self._free:
            old = self._tails
            rows = old.shape[0] - 1
            if self.device.type == "cuda":
                # Once per doubling of the streams: the batch in flight on the codec's stream
                # may still write the old tails, which this thread's copy must not outrun.
                torch.cuda.synchronize(self.device)
            self._tails = torch.zeros((2 * rows + 1, CONTEXT), device=self.device)
            self._tails[: rows + 1].copy_(old)  # once per doubling, not per chunk
            self._free = list(range(2 * rows, rows, -1))
        return self._free.pop()

    def release(self, slot: int) -> None:
        if slot > 0:
            self._free.append(slot)

    # -- marking --------------------------------------------------------------------------------
    @torch.inference_mode()
    def mark(self, audio: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """Mark ``audio (n, N)`` float, the next chunk of the streams whose tails are at
        ``slots (n,)`` int64; rows with ``fresh (n,)`` are first chunks (silence before them).
        Returns the marked chunks ``(n, N)`` and moves each stream's tail on."""
        tails = self._tails.index_select(0, slots)
        tails.mul_((~fresh).to(tails.dtype)[:, None])
        x = torch.cat((tails, audio), dim=1)
        # The stream's next tail: its unmarked audio, so that later marks see what the
        # network would see in one pass over the utterance.
        self._tails.index_copy_(0, slots, x[:, -CONTEXT:])
        x = torch.cat((x, x[:, -AHEAD - 1 : -1].flip(1)), dim=1)
        marked = audio + self.delta(x)[:, CONTEXT : CONTEXT + audio.shape[1]]
        return marked.clamp_(-1.0, 1.0)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """PerTh's mark for audio ``x (B, L)`` as samples to add to it."""
        s = self.spectral
        spec = s.stft(x)
        norm = s.normalised(spec)
        mask = self.parts.magmask(norm)[:, None]  # (B, 1, T)
        residual = self.parts.encoder.layers(norm[:, : self.subband]) * mask
        change = spec[:, : self.subband] * (s.gain(residual) - 1.0)
        full = torch.nn.functional.pad(change, (0, 0, 0, BINS - self.subband))
        return s.istft(full, x.shape[1])

    # -- reading ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def score(self, audio: torch.Tensor) -> float:
        """PerTh's decoder on one 24 kHz clip ``(L,)`` float: its confidence in [0, 1] that
        the clip is marked (what ``PerthImplicitWatermarker.get_watermark`` returns unrounded)."""
        if audio.ndim != 1 or audio.shape[0] < 2 * HOP:
            raise ValueError("expected a mono clip of at least 20 ms")
        norm = self.spectral.normalised(self.spectral.stft(audio[None].to(self.device)))
        return float(self.parts.decoder(norm)[0].clamp(0.0, 1.0))
