"""``orpheus-serve bench codec [--json FILE]``: the reference streaming decoder against this
worker, side by side in one run, on SNAC's real architecture (random weights unless --model).

Variants, alternated within each round at each concurrency:

- ``reference``: Orpheus-TTS's approach. Each stream decodes its own last 4 frames after every
  frame, one ``SNAC.decode`` call per chunk (weight norms unfused, fresh noise).
- ``worker``: the codec worker's service (scheduler, 2D batching, cropped decoder) with all of
  each stream's codes queued: a saturated codec, what capacity is about.
- ``worker-lockstep``: the same service fed one frame per stream at a time, decoding in
  between: a codec that keeps up, so every window is one frame (no time axis).

Throughput is emitted audio seconds per wall second; CPU is process CPU seconds (all threads)
per emitted audio second. Seam quality compares each approach's concatenated chunks with one
offline decode of the same codes in dB (lower is better): the reference against an offline
decode with its own fresh noise (as it runs), and, to isolate its windows, with positional
noise (``reference-fixed-noise``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from snac import SNAC

from bench.codec.quality import error_db
from bench.lib.report import environment, show, table, write_json
from codec_worker.decoder import WindowDecoder, WindowKey
from codec_worker.engine import PCM_SCALE, DecodeEngine
from codec_worker.host_memory import retain_freed_memory
from codec_worker.levels import frames_to_levels
from codec_worker.noise import decode_seed
from codec_worker.output import CollectingSink
from codec_worker.policy import WindowPolicy
from codec_worker.service import CodecService
from codec_worker.snac_model import SNAC_24KHZ, fuse_weight_norm, load_snac
from codec_worker.watermark import StreamWatermark
from common.config.codec import CodecConfig
from shm.records import SAMPLE_RATE, SAMPLES_PER_FRAME, RecordKind, StreamEnd, record_encoder
from shm.ring import Record
from testkit.reference_decoder import (
    FIRST_CHUNK_FRAMES,
    WINDOW_FRAMES,
    reference_chunk,
    reference_emitted_frames,
    reference_stream,
)
from testkit.tiny_model import random_snac

VARIANTS = ("reference", "worker", "worker-lockstep")


@dataclass
class Run:
    variant: str
    streams: int
    wall_s: float
    cpu_s: float
    audio_s: float
    batches: int = 0
    windows: int = 0

    @property
    def audio_s_per_s(self) -> float:
        return self.audio_s / self.wall_s

    @property
    def cpu_s_per_audio_s(self) -> float:
        return self.cpu_s / self.audio_s


def _measure(fn: Callable[[], tuple[float, int, int]]) -> tuple[float, float, float, int, int]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    audio_s, batches, windows = fn()
    return time.perf_counter() - wall0, time.process_time() - cpu0, audio_s, batches, windows


class WorkerHarness:
    """The real CodecService and DecodeEngine, fed in-process, PCM collected in memory."""

    def __init__(
        self,
        decoder: WindowDecoder,
        cfg: CodecConfig,
        device: torch.device,
        watermark: StreamWatermark | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = DecodeEngine.for_config(decoder, cfg, device, watermark)

    def run(self, codes: np.ndarray, lockstep: bool) -> tuple[CollectingSink, int, int]:
        """Decode ``codes (streams, frames, 7)``; returns the sink, batches and windows."""
        cfg = self.cfg if not lockstep else _replace(self.cfg, hold_ahead_ms=-1.0)
        sink = CollectingSink()
        svc = CodecService(cfg, self.engine, sink, gateways=1)
        n_streams, n_frames, _ = codes.shape

        def pump_all() -> None:
            while svc.pump():
                pass

        steps = [(0, n_frames)] if not lockstep else [(f, f + 1) for f in range(n_frames)]
        for a, b in steps:
            svc.ingest(
                Record(RecordKind.CODES, sid + 1, a, memoryview(codes[sid, a:b].tobytes()))
                for sid in range(n_streams)
            )
            pump_all()
        end = memoryview(record_encoder.encode(StreamEnd("stop", n_frames)))
        svc.ingest(Record(RecordKind.END, sid + 1, n_frames, end) for sid in range(n_streams))
        pump_all()
        if svc.streams:
            raise RuntimeError(f"{len(svc.streams)} streams did not finish")
        return sink, svc.batches, svc.windows


def _replace(cfg: CodecConfig, **changes: Any) -> CodecConfig:
    import msgspec

    return msgspec.structs.replace(cfg, **changes)


def pcm_by_stream(sink: CollectingSink) -> dict[int, np.ndarray]:
    out: dict[int, list[bytes]] = {}
    for _, kind, sid, _, payload in sink.records:
        if kind == RecordKind.PCM:
            out.setdefault(sid, []).append(payload)
    return {sid: np.frombuffer(b"".join(p), dtype="<i2") for sid, p in out.items()}


def audio_seconds(sink: CollectingSink) -> float:
    samples = sum(len(p) // 2 for _, kind, _, _, p in sink.records if kind == RecordKind.PCM)
    return samples / SAMPLE_RATE


def _to_pcm(audio: torch.Tensor) -> np.ndarray:
    return (audio * PCM_SCALE).round().to(torch.int16).cpu().numpy()


# -- seam quality ------------------------------------------------------------------------------
def seam_quality(
    ref_model: SNAC,
    decoder: WindowDecoder,
    harness: WorkerHarness,
    codes: np.ndarray,
    device: torch.device,
    noise_seed: int,
) -> dict[str, float]:
    """Each approach's streamed audio against one offline decode of the same codes, in dB."""
    n_streams, n, _ = codes.shape
    frames = torch.from_numpy(codes.astype(np.int64)).to(device)
    # The worker gives every stream the same position-keyed noise (noise.decode_seed).
    seeds = torch.full((n_streams,), decode_seed(noise_seed), dtype=torch.int64, device=device)
    with torch.inference_mode():
        offline = _to_pcm(decoder.decode_offline(frames, seeds))
        emitted = reference_emitted_frames(n)
        lo, hi = emitted.start * SAMPLES_PER_FRAME, emitted.stop * SAMPLES_PER_FRAME
        # The reference against an offline decode with the same (fresh) noise treatment.
        ref_offline = _to_pcm(ref_model.decode(list(frames_to_levels(frames)))[:, 0])
        ref_fixed = []
        key = WindowKey(EMITTED_CONTEXT, 1, WINDOW_FRAMES - 1 - EMITTED_CONTEXT)
        for f in range(WINDOW_FRAMES - 1, n):
            start = f - WINDOW_FRAMES + 1
            starts = torch.full((n_streams,), start, dtype=torch.int64, device=device)
            ref_fixed.append(decoder.decode(frames[:, start : f + 1], seeds, starts, key))
        ref_fixed_pcm = _to_pcm(torch.cat(ref_fixed, dim=1))
    out: dict[str, list[float]] = {k: [] for k in ("reference", "reference-fixed-noise")}
    for s in range(n_streams):
        chunks = reference_stream(ref_model, codes[s], device)
        streamed = np.frombuffer(b"".join(chunks), dtype="<i2")
        out["reference"].append(error_db(streamed, ref_offline[s, lo:hi]))
        out["reference-fixed-noise"].append(error_db(ref_fixed_pcm[s], offline[s, lo:hi]))
    for variant, lockstep in (("worker", False), ("worker-lockstep", True)):
        pcm = pcm_by_stream(harness.run(codes, lockstep)[0])
        out[variant] = [error_db(pcm[s + 1], offline[s]) for s in range(n_streams)]
    return {k: float(np.mean(v)) for k, v in out.items()}


EMITTED_CONTEXT = 1
"""The reference emits the second frame of its 4-frame window: context 1, lookahead 2."""

SWEEP = [
    # (context, lookahead, first lookahead)
    (0, 1, 1),
    (1, 1, 1),
    (1, 2, 0),
    (1, 2, 1),
    (1, 2, 2),
    (1, 3, 1),
    (2, 0, 1),
    (2, 1, 0),
    (2, 1, 1),
    (2, 2, 1),
    (2, 2, 2),
    (3, 1, 1),
    (3, 2, 1),
    (4, 1, 1),
]


def policy_sweep(
    decoder: WindowDecoder, cfg: CodecConfig, codes: np.ndarray, device: torch.device
) -> list[dict[str, float]]:
    """Seam quality and cost of window policies, fed a frame at a time (every seam is a
    one-frame hop: the worst case for seams and for redundant compute)."""
    n_streams, n, _ = codes.shape
    frames = torch.from_numpy(codes.astype(np.int64)).to(device)
    seeds = torch.full((n_streams,), decode_seed(cfg.noise_seed), dtype=torch.int64)
    with torch.inference_mode():
        offline = _to_pcm(decoder.decode_offline(frames, seeds.to(device)))
    rows = []
    for ctx, la, first_la in SWEEP:
        variant = _replace(
            cfg, context_frames=ctx, lookahead_frames=la, first_lookahead_frames=first_la
        )
        harness = WorkerHarness(decoder, variant, device)
        cpu0 = time.process_time()
        pcm = pcm_by_stream(harness.run(codes, lockstep=True)[0])
        cpu = time.process_time() - cpu0
        db = [error_db(pcm[s + 1], offline[s]) for s in range(n_streams)]
        rows.append(
            {
                "context": ctx,
                "lookahead": la,
                "first_lookahead": first_la,
                "first_chunk_frames": variant.first_hop_frames + first_la,
                "seam_db": float(np.mean(db)),
                "cpu_s_per_audio_s": cpu / (n_streams * n * SAMPLES_PER_FRAME / SAMPLE_RATE),
            }
        )
    return rows


def print_sweep(rows: list[dict[str, float]]) -> None:
    columns = ("context", "lookahead", "first lookahead", "first chunk frames", "seam dB",
               "CPU s / audio s")  # fmt: skip
    cells = [
        (
            str(r["context"]),
            str(r["lookahead"]),
            str(r["first_lookahead"]),
            str(r["first_chunk_frames"]),
            f"{r['seam_db']:.1f}",
            f"{r['cpu_s_per_audio_s']:.2f}",
        )
        for r in rows
    ]
    title = "window policies, one frame per window (seam dB: lower is better)"
    show(table(title, columns, cells))


# -- report ------------------------------------------------------------------------------------
def header() -> dict[str, dict[str, Any]]:
    """The machine and versions, with torch's threads and SNAC's version."""
    from importlib import metadata

    try:
        snac = {"snac": metadata.version("snac")}
    except metadata.PackageNotFoundError:
        snac = {}
    return environment({"torch_threads": torch.get_num_threads()}, snac)


def print_report(runs: dict[int, dict[str, Run]], seam: dict[str, float], first: int) -> None:
    columns = ("streams", "variant", "audio s/s", "CPU s / audio s", "x reference",
               "windows/batch")  # fmt: skip
    rows: list[tuple[str, ...] | None] = []
    for n, by_variant in runs.items():
        ref = by_variant["reference"]
        for v in VARIANTS:
            r = by_variant[v]
            per_batch = f"{r.windows / r.batches:.1f}" if r.batches else "1 (per call)"
            rows.append((
                str(n), v, f"{r.audio_s_per_s:.3f}", f"{r.cpu_s_per_audio_s:.2f}",
                f"{r.audio_s_per_s / ref.audio_s_per_s:.2f}", per_batch,
            ))  # fmt: skip
        rows.append(None)
    show(table("codec: reference (one decode per chunk) vs worker (2D batched)", columns, rows))
    seam_rows = [(k, f"{v:.1f}") for k, v in seam.items()]
    title = "seam quality: streamed vs one offline decode (dB, lower is better)"
    show(
        table(title, ("variant", "error dB"), seam_rows, left={"variant"}),
        f"first chunk needs {first} frames (reference: {FIRST_CHUNK_FRAMES})",
        "random weights: the decoded audio is noise, not speech",
    )


# -- main --------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench codec", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--streams", default="1,8,32", help="concurrency levels (comma-separated)")
    p.add_argument("--frames", type=int, default=12, help="frames per stream per run")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds per level")
    p.add_argument("--seam-frames", type=int, default=24)
    p.add_argument("--seam-streams", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--model", help="SNAC checkpoint (HF name or dir); default: random weights")
    p.add_argument("--compile", action="store_true", help="torch.compile the worker's decoder")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", action="append", default=[], help="codec config key=value")
    p.add_argument(
        "--watermark-ab",
        action="store_true",
        help="only measure the watermark's cost: the worker with codec.watermark off and perth, "
        "alternated (bench/codec/watermark.py)",
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="only measure seam quality and cost of several window policies",
    )
    return p.parse_args(argv)


def _codec_config(args: argparse.Namespace, max_streams: int) -> CodecConfig:
    import msgspec

    overrides: dict[str, Any] = {"max_batch": max(64, max_streams), "compile": args.compile}
    for pair in args.set:
        key, _, raw = pair.partition("=")
        try:
            overrides[key.strip()] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key.strip()] = raw
    return msgspec.convert(overrides, CodecConfig)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        retain_freed_memory()  # as the codec worker does on CPU; the reference gains as well
    levels = [int(x) for x in args.streams.split(",") if x]
    if args.frames < WINDOW_FRAMES or args.seam_frames < WINDOW_FRAMES:
        print(f"--frames and --seam-frames must be >= {WINDOW_FRAMES}", file=sys.stderr)
        return 2
    cfg = _codec_config(args, max(levels))
    if args.model:
        ref_model = load_snac(args.model, device, fuse=False)
        worker_snac = load_snac(args.model, "cpu")
    else:
        ref_model = random_snac(args.seed, SNAC_24KHZ).to(device)
        worker_snac = fuse_weight_norm(random_snac(args.seed, SNAC_24KHZ))
    decoder = WindowDecoder(worker_snac)
    rng = np.random.default_rng(args.seed)
    if args.sweep:
        codes = rng.integers(0, 4096, (args.seam_streams, args.seam_frames, 7)).astype("<i2")
        rows = policy_sweep(decoder, cfg, codes, device)
        print_sweep(rows)
        if args.json:
            doc = {"benchmark": "codec-window-policies", **header()}
            write_json(doc | {"seam_frames": args.seam_frames, "policies": rows}, args.json)
        return 0
    if args.watermark_ab:
        from bench.codec.watermark import watermark_ab

        return watermark_ab(args, decoder, cfg, device, levels, rng, header())
    harness = WorkerHarness(decoder, cfg, device)
    warm_s = harness.engine.warmup()

    runs: dict[int, dict[str, Run]] = {}
    for n in levels:
        codes = rng.integers(0, 4096, (n, args.frames, 7)).astype("<i2")
        acc: dict[str, list[Run]] = {v: [] for v in VARIANTS}
        for rnd in range(args.rounds):
            order = VARIANTS[rnd % 3 :] + VARIANTS[: rnd % 3]
            for v in order:
                acc[v].append(_run_variant(v, n, codes, ref_model, harness, device))
        runs[n] = {v: _combine(rs) for v, rs in acc.items()}
        _log_level(n, runs[n])
    seam_codes = rng.integers(0, 4096, (args.seam_streams, args.seam_frames, 7)).astype("<i2")
    seam = seam_quality(ref_model, decoder, harness, seam_codes, device, cfg.noise_seed)
    policy = WindowPolicy(cfg)
    first = policy.first_window_frames
    print_report(runs, seam, first)
    top = max(levels)
    result = {
        "benchmark": "codec",
        **header(),
        "device": str(device),
        "config": {**run_config(args, cfg), "warmup_s": round(warm_s, 3)},
        "streams": levels,
        "reference_audio_s_per_s": [runs[n]["reference"].audio_s_per_s for n in levels],
        "worker_audio_s_per_s": [runs[n]["worker"].audio_s_per_s for n in levels],
        "worker_lockstep_audio_s_per_s": [runs[n]["worker-lockstep"].audio_s_per_s for n in levels],
        "ratio_batched_vs_reference": runs[top]["worker"].audio_s_per_s
        / runs[top]["reference"].audio_s_per_s,
        "ratio_lockstep_vs_reference": runs[top]["worker-lockstep"].audio_s_per_s
        / runs[top]["reference"].audio_s_per_s,
        "seam_db_reference": seam["reference"],
        "seam_db_reference_fixed_noise": seam["reference-fixed-noise"],
        "seam_db_worker": seam["worker"],
        "seam_db_worker_lockstep": seam["worker-lockstep"],
        "first_chunk_frames": first,
        "first_chunk_frames_reference": FIRST_CHUNK_FRAMES,
        "levels": [
            {
                "streams": n,
                **{
                    f"{v.replace('-', '_')}_{k}": val
                    for v in VARIANTS
                    for k, val in _run_fields(runs[n][v]).items()
                },
            }
            for n in levels
        ],
        "note": "random weights: the decoded audio is noise, not speech",
    }
    write_json(result, args.json, announce=sys.stdout)
    return 0


def _run_variant(
    variant: str,
    n: int,
    codes: np.ndarray,
    ref_model: SNAC,
    harness: WorkerHarness,
    device: torch.device,
) -> Run:
    if variant == "reference":

        def go() -> tuple[float, int, int]:
            samples = 0
            # Streams interleaved as they would be served: every stream's chunk for frame f.
            for f in range(WINDOW_FRAMES - 1, codes.shape[1]):
                for s in range(n):
                    window = codes[s, f - WINDOW_FRAMES + 1 : f + 1]
                    samples += len(reference_chunk(ref_model, window, device)) // 2
            return samples / SAMPLE_RATE, 0, 0

    else:

        def go() -> tuple[float, int, int]:
            sink, batches, windows = harness.run(codes, lockstep=variant == "worker-lockstep")
            return audio_seconds(sink), batches, windows

    wall, cpu, audio, batches, windows = _measure(go)
    return Run(variant, n, wall, cpu, audio, batches, windows)


def _combine(runs: list[Run]) -> Run:
    r0 = runs[0]
    return Run(
        r0.variant,
        r0.streams,
        sum(r.wall_s for r in runs),
        sum(r.cpu_s for r in runs),
        sum(r.audio_s for r in runs),
        sum(r.batches for r in runs),
        sum(r.windows for r in runs),
    )


def _run_fields(r: Run) -> dict[str, float]:
    d = asdict(r)
    d.pop("variant")
    d.pop("streams")
    d["audio_s_per_s"] = r.audio_s_per_s
    d["cpu_s_per_audio_s"] = r.cpu_s_per_audio_s
    return d


def run_config(args: argparse.Namespace, cfg: CodecConfig) -> dict[str, Any]:
    """The ``config`` of a codec result (this bench's and the watermark A/B's): the codec's
    configuration and the run's sizes."""
    import msgspec

    return {
        "codec": msgspec.to_builtins(cfg),
        "frames_per_stream": args.frames,
        "rounds": args.rounds,
        "seam_frames": args.seam_frames,
        "seam_streams": args.seam_streams,
        "weights": args.model or f"random (seed {args.seed})",
    }


def _log_level(n: int, by_variant: dict[str, Run]) -> None:
    ref = by_variant["reference"].audio_s_per_s
    parts = [
        f"{v} {r.audio_s_per_s:.3f} audio s/s ({r.audio_s_per_s / ref:.2f}x)"
        for v, r in by_variant.items()
    ]
    print(f"[{n} streams] " + ", ".join(parts), flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
