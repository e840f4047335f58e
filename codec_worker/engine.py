"""Runs batches of decode windows on the device: gather, decode, scatter.

One batch is a list of groups, one group per window shape. The engine copies each window's
codes into a reused (pinned, on CUDA) host buffer, and on CUDA launches everything on its own
stream: host-to-device copies, one decoder call per group, the int16 conversion and the
device-to-host copy of the PCM into a reused pinned buffer. ``PendingBatch.wait`` is the one
synchronisation per batch. The same code runs on CPU, where ``submit`` computes synchronously.

With ``compile`` the hot shapes (first window and steady hops) run through ``torch.compile``:
one graph per shape with a dynamic batch dimension, the batch padded to a bucket (so CUDA-graph
modes record a bounded set). All are compiled and warmed on every bucket before the worker says
it is ready. Other shapes (a short utterance, an END flush) run eagerly.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from codec_worker.decoder import WindowDecoder, WindowKey, WindowPlan
from codec_worker.host_memory import HeapBound
from codec_worker.watermark import StreamWatermark
from common.config.codec import CodecConfig
from shm.records import CODE_DTYPE, FRAME_CODES

log = logging.getLogger(__name__)

PCM_SCALE = 32767.0
MIN_COMPILED_ROWS = 2


class DecodeRequest(NamedTuple):
    """One window: its ``(W, 7)`` int16 codes (copied at submit), noise seed, first frame, and
    its stream's watermark slot (0: none, the scratch slot)."""

    codes: np.ndarray
    seed: int
    start: int
    slot: int = 0


def to_pcm(audio: torch.Tensor) -> torch.Tensor:
    """Float audio in [-1, 1] -> int16 PCM."""
    return (audio * PCM_SCALE).round().to(torch.int16)


class PcmDecoder(nn.Module):
    """WindowDecoder followed by the int16 conversion (one graph when compiled); with
    ``quantize=False`` the float audio (the watermark marks it before the conversion)."""

    def __init__(self, decoder: WindowDecoder, quantize: bool = True) -> None:
        super().__init__()
        self.decoder = decoder
        self.quantize = quantize

    def forward(
        self, frames: torch.Tensor, seeds: torch.Tensor, starts: torch.Tensor, plan: WindowPlan
    ) -> torch.Tensor:
        audio = self.decoder(frames, seeds, starts, plan)
        return to_pcm(audio) if self.quantize else audio


@contextlib.contextmanager
def nvtx_range(name: str, enabled: bool, profiled: bool = False) -> Iterator[None]:
    """An NVTX range (for Nsight) when ``enabled``; also a torch-profiler range while a
    capture runs (``profiled``: the torch profiler does not record NVTX)."""
    if enabled:
        torch.cuda.nvtx.range_push(name)
    try:
        if profiled:
            with torch.profiler.record_function(name):
                yield
        else:
            yield
    finally:
        if enabled:
            torch.cuda.nvtx.range_pop()


class PendingBatch:
    """A submitted batch; ``wait`` returns each group's PCM ``(n, hop * 2048)`` int16."""

    def __init__(self, pcm: list[np.ndarray], event: torch.cuda.Event | None, t0: float) -> None:
        self._pcm = pcm
        self._event = event
        self.submitted_at = t0
        self.decode_s = 0.0

    def wait(self) -> list[np.ndarray]:
        if self._event is not None:
            # The one sync per batch: the PCM must be on the host before it goes to the rings.
            # The event is a blocking-sync event, so this thread sleeps instead of spinning.
            self._event.synchronize()
        # Valid until the next submit: callers copy what they keep (the ring append copies).
        self.decode_s = time.perf_counter() - self.submitted_at
        return self._pcm


class DecodeEngine:
    """Owns the decoder on its device, its buffers, CUDA stream and compiled graphs."""

    def __init__(
        self,
        decoder: WindowDecoder,
        cfg: CodecConfig,
        device: torch.device,
        *,
        max_window_frames: int,
        max_hop_frames: int,
        hot_keys: Sequence[WindowKey] = (),
        watermark: StreamWatermark | None = None,
    ) -> None:
        self.cfg = cfg
        self.watermark = watermark
        """Marks each window's audio before the int16 conversion (codec.watermark; None: off)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.profiling = False
        """Set while a torch-profiler capture runs (codec_worker.profiling): ranges are recorded."""
        self.decoder = decoder.to(device).eval()
        self.model = PcmDecoder(self.decoder, quantize=watermark is None).eval()
        self.buckets = sorted(set(cfg.batch_buckets))
        # Padding to buckets can at most double a group; several groups share the buffers.
        rows = 2 * max(cfg.max_batch, self.buckets[-1] if self.buckets else 1)
        self.max_rows = rows
        self.max_window_frames = max_window_frames
        samples = decoder.samples_per_frame
        pin = self.cuda
        self._codes_host = torch.zeros(rows * max_window_frames * FRAME_CODES, dtype=torch.int16)
        self._meta_host = torch.zeros((3, rows), dtype=torch.int64)  # seeds, starts, slots
        self._pcm_host = torch.zeros(rows * max_hop_frames * samples, dtype=torch.int16)
        if pin:
            self._codes_host = self._codes_host.pin_memory()
            self._meta_host = self._meta_host.pin_memory()
            self._pcm_host = self._pcm_host.pin_memory()
        self._codes_np = self._codes_host.numpy()
        self._meta_np = self._meta_host.numpy()
        self._pcm_np = self._pcm_host.numpy()
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        if self.cuda:
            self._codes_dev = torch.zeros_like(self._codes_host, device=device)
            self._meta_dev = torch.zeros_like(self._meta_host, device=device)
            self._stream = torch.cuda.Stream(device)
            self._event = torch.cuda.Event(blocking=True)
        self.hot_keys = list(dict.fromkeys(hot_keys))
        self.heap: HeapBound | None = None if self.cuda else HeapBound()
        """On CPU: the free host memory a flood's batches leave goes back (host_memory.py)."""
        self._compiled: nn.Module | None = None
        if cfg.compile:
            self._compiled = self._compile()

    @classmethod
    def for_config(
        cls,
        decoder: WindowDecoder,
        cfg: CodecConfig,
        device: torch.device,
        watermark: StreamWatermark | None = None,
    ) -> DecodeEngine:
        """An engine sized for ``cfg``'s window policy, its hot shapes being compiled/warmed."""
        from codec_worker.policy import WindowPolicy

        policy = WindowPolicy(cfg)
        return cls(
            decoder,
            cfg,
            device,
            max_window_frames=policy.max_window_frames,
            max_hop_frames=policy.max_hop_frames,
            hot_keys=policy.hot_keys(),
            watermark=watermark,
        )

    # -- compile and warm-up ---------------------------------------------------------------------
    def _compile(self) -> nn.Module:
        import torch._dynamo.config as dynamo_config

        # One graph per hot shape and per batch-size class: raise the recompile limit to fit.
        wanted = 4 * max(1, len(self.hot_keys)) * max(1, len(self.buckets))
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), wanted))
        mode = None if self.cfg.compile_mode == "default" else self.cfg.compile_mode
        # dynamic=False: window plans and lengths stay static (one graph per hot shape); only
        # the batch dimension is dynamic, marked explicitly in _run.
        return torch.compile(self.model, mode=mode, dynamic=False)  # type: ignore[return-value]

    def warmup(self) -> float:
        """Run every hot shape (at every batch bucket when compiled). Returns seconds taken."""
        t0 = time.perf_counter()
        if self._compiled is not None:
            sizes = sorted({self._rows_for(self.hot_keys[0], b) for b in self.buckets})
        else:
            sizes = [1]
        for key in self.hot_keys:
            for n in sizes:
                if n > max(self.cfg.max_batch, MIN_COMPILED_ROWS):
                    continue
                codes = np.zeros((key.frames, FRAME_CODES), CODE_DTYPE)
                self.submit([(key, [DecodeRequest(codes, 0, 0)] * n)]).wait()
        dt = time.perf_counter() - t0
        log.info(
            "codec warm-up: %d shapes x %s batch sizes in %.1fs", len(self.hot_keys), sizes, dt
        )
        return dt

    def _rows_for(self, key: WindowKey, n: int) -> int:
        if self._compiled is None or key not in self.hot_keys:
            return n
        for b in self.buckets:
            if b >= n:
                return max(b, MIN_COMPILED_ROWS)
        return max(n, MIN_COMPILED_ROWS)

    # -- one batch -------------------------------------------------------------------------------
    def submit(self, groups: Sequence[tuple[WindowKey, Sequence[DecodeRequest]]]) -> PendingBatch:
        """Stage and launch one batch (asynchronous on CUDA, synchronous on CPU)."""
        t0 = time.perf_counter()
        nvtx, prof = self.cuda, self.profiling
        staged: list[tuple[WindowKey, int, int, int, int, int]] = []
        el = row = 0
        with nvtx_range("codec.gather", nvtx, prof):
            for key, reqs in groups:
                n = len(reqs)
                rows = self._rows_for(key, n)
                w = key.frames
                size = rows * w * FRAME_CODES
                if row + rows > self.max_rows or w > self.max_window_frames:
                    raise ValueError(
                        f"batch exceeds the engine's buffers ({row + rows} rows, {key})"
                    )
                codes = self._codes_np[el : el + size].reshape(rows, w, FRAME_CODES)
                seeds, starts, slots = self._meta_np
                for i, r in enumerate(reqs):
                    codes[i] = r.codes
                    seeds[row + i] = r.seed
                    starts[row + i] = r.start
                    slots[row + i] = r.slot
                if rows > n:  # bucket padding: valid codes, results discarded
                    codes[n:] = 0
                    seeds[row + n : row + rows] = 0
                    starts[row + n : row + rows] = 0
                    slots[row + n : row + rows] = 0
                staged.append((key, n, rows, el, size, row))
                el += size
                row += rows
        pcm_out: list[np.ndarray] = []
        pcm_off = 0
        stream = torch.cuda.stream(self._stream) if self._stream is not None else None
        with torch.inference_mode(), stream or contextlib.nullcontext():
            if self.cuda:
                with nvtx_range("codec.h2d", nvtx, prof):
                    self._codes_dev[:el].copy_(self._codes_host[:el], non_blocking=True)
                    self._meta_dev.copy_(self._meta_host, non_blocking=True)  # 3 x rows int64
                codes_src, meta_src = self._codes_dev, self._meta_dev
            else:
                codes_src, meta_src = self._codes_host, self._meta_host
            for key, n, rows, el0, size, row0 in staged:
                frames = codes_src[el0 : el0 + size].view(rows, key.frames, FRAME_CODES)
                seeds = meta_src[0, row0 : row0 + rows]
                starts = meta_src[1, row0 : row0 + rows]
                with nvtx_range(f"codec.decode[{rows}x{key.hop}]", nvtx, prof):
                    pcm = self._run(key, frames, seeds, starts)
                if self.watermark is not None:
                    with nvtx_range(f"codec.watermark[{n}x{key.hop}]", nvtx, prof):
                        slots = meta_src[2, row0 : row0 + n]
                        fresh = (starts[:n] + key.context) == 0  # the stream's first audio
                        pcm = to_pcm(self.watermark.mark(pcm[:n], slots, fresh))
                samples = pcm.shape[1]
                host = self._pcm_host[pcm_off : pcm_off + n * samples].view(n, samples)
                with nvtx_range("codec.d2h", nvtx, prof):
                    host.copy_(pcm[:n], non_blocking=self.cuda)
                pcm_out.append(self._pcm_np[pcm_off : pcm_off + n * samples].reshape(n, samples))
                pcm_off += n * samples
            if self._event is not None:
                self._event.record(self._stream)
        if self.heap is not None:  # CPU: the batch is done and its activations are freed
            self.heap.after_batch(time.monotonic())
        return PendingBatch(pcm_out, self._event, t0)

    def _run(
        self, key: WindowKey, frames: torch.Tensor, seeds: torch.Tensor, starts: torch.Tensor
    ) -> torch.Tensor:
        plan = self.decoder.plan(key)
        if self._compiled is not None and key in self.hot_keys:
            # One graph per hot shape for all batch buckets (rows >= 2: size 1 would be
            # specialised into a second graph; padding one window costs less than compiling).
            for t in (frames, seeds, starts):
                torch._dynamo.mark_dynamic(t, 0)
            return self._compiled(frames, seeds, starts, plan)
        return self.model(frames, seeds, starts, plan)
