"""Configuration of the codec_worker process (the ``[codec]`` table of the TOML file)."""

from __future__ import annotations

from typing import Literal

import msgspec


class CodecConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    model: str = "hubertsiuzdak/snac_24khz"
    """HF name or local directory (config.json + pytorch_model.bin) of the SNAC 24 kHz codec."""
    context_frames: int = 2
    """Frames before the emitted ones in a window. Chosen by measurement (``orpheus-serve bench
    codec --sweep``, docs/performance.md): with cropping, context costs almost no compute, and
    context 2 with lookahead 2 joins chunks at -53 dB against -40 dB for the reference's 1/2."""
    hop_frames: int = 1
    """Smallest hop of a steady window; hops are hop_frames * 2**k up to max_hop_frames."""
    lookahead_frames: int = 2
    first_hop_frames: int = 1
    """Frames emitted by a stream's first window (its lookahead is first_lookahead_frames)."""
    first_lookahead_frames: int = 1
    """1: first audio after 2 frames, its seam at -53 dB; 2: after 3 frames, -78 dB."""
    max_hop_frames: int = 8
    """Time axis of 2D batching: a stream with a backlog emits up to this many frames per window."""
    max_batch: int = 64
    max_wait_ms: float = 5.0
    hold_ahead_ms: float = 500.0
    """A stream this far ahead of its playback deadline waits until it can fill a max_hop_frames
    window (fewer, longer windows: less redundant context). Negative disables holding."""
    late_lookahead_ms: float = 20.0
    """A stream whose next frame is due at the gateway within the recent batch decode time plus
    this margin does not wait for its steady lookahead: it emits one frame with
    first_lookahead_frames (a seam like its first one) rather than a gap. Mostly a stream's
    second window, which needs two more frames than its first. Negative: always wait."""
    compile: bool = False
    """torch.compile the decoder (GPU), warmed on every batch bucket."""
    compile_mode: str = "default"
    """torch.compile mode: default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs."""
    batch_buckets: list[int] = msgspec.field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64])
    """Batch sizes the compiled decoder is warmed on; a batch is padded up to the next one."""
    noise_seed: int = 0
    threads: int = 0
    """torch intra-op threads on CPU; 0 leaves torch's default."""
    watermark: Literal["perth", "off"] = "perth"
    """The imperceptible mark every second of audio carries (README, Watermark): ``perth``,
    Resemble's PerTh (resemble-perth's trained weights, on the codec's device), applied to each
    chunk after decoding, before any front end encodes it. ``off`` emits unmarked audio: an
    operator serving the public in the EU then marks it some other way (EU AI Act art. 50(2);
    docs/operations.md). A watermark that cannot load stops the server at start (exit 78)."""
    pcm_stall_timeout_s: float = 5.0
    """A gateway's PCM ring that stays full this long fails the streams waiting on it."""
