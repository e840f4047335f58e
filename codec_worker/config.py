"""Configuration of the codec_worker process (the ``[codec]`` table of the TOML file)."""

from __future__ import annotations

import msgspec


class CodecConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str = "hubertsiuzdak/snac_24khz"
    """HF name or local directory (config.json + pytorch_model.bin) of the SNAC 24 kHz codec."""
    context_frames: int = 1
    hop_frames: int = 1
    lookahead_frames: int = 2
    first_hop_frames: int = 1
    """Frames emitted by a stream's first window (its lookahead is first_lookahead_frames)."""
    first_lookahead_frames: int = 1
    max_hop_frames: int = 8
    """Time axis of 2D batching: a stream with a backlog emits up to this many frames per window."""
    max_batch: int = 64
    max_wait_ms: float = 5.0
    compile: bool = False
    """torch.compile the decoder (GPU), warmed on every batch bucket."""
    batch_buckets: list[int] = [1, 2, 4, 8, 16, 32, 64]
    noise_seed: int = 0
    threads: int = 0
    """torch intra-op threads on CPU; 0 leaves torch's default."""
