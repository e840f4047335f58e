"""``orpheus-serve bench codec --watermark-ab``: what the watermark costs the codec worker.

The worker's service and engine (``bench.codec.WorkerHarness``) with ``codec.watermark`` off
and ``perth``, alternated within each round at each concurrency, on the same codes:

- ``saturated``: every stream's codes queued (a saturated codec: capacity), audio s/s and
  CPU s per audio s;
- ``lockstep``: one frame per stream at a time (a codec that keeps up: every window one
  frame, the watermark's worst case, its context and mirror around 2,048 samples);
- ``first chunk``: from the first frames of every stream to their first PCM (the codec's part
  of the time to first audio), the median over the rounds;
- seams: each arm's streamed audio against one offline decode (marked in one pass for perth);
- per window: the decoder's and the mark's time on one window shape and batch, each the best
  of ``REPS`` calls (the least disturbed by other work on a shared machine: the whole-run
  figures above move by tens of percent under load, these by a few).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from bench.codec.cli import WorkerHarness, audio_seconds, pcm_by_stream, run_config
from bench.codec.quality import error_db
from bench.lib.report import show, table, write_json
from codec_worker.decoder import WindowDecoder, WindowKey
from codec_worker.engine import PCM_SCALE
from codec_worker.noise import decode_seed
from codec_worker.output import CollectingSink
from codec_worker.policy import WindowPolicy
from codec_worker.service import CodecService
from codec_worker.watermark import StreamWatermark, load_watermark
from common.config.codec import CodecConfig
from shm.records import RecordKind, StreamEnd, record_encoder
from shm.ring import Record

ARMS = ("off", "perth")
REPS = 15
WINDOWS = ((1, 1, 0, 1), (1, 1, 2, 2), (8, 1, 2, 2), (1, 8, 2, 2), (8, 8, 2, 2))
"""(batch, hop, context, lookahead): a stream's first window, one-frame and eight-frame
steady windows, alone and eight in a batch."""


def _best_s(device: torch.device, fn: Any, *args: Any) -> float:
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        fn(*args)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the timing needs the work done
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def _per_window(
    decoder: WindowDecoder, watermark: StreamWatermark, device: torch.device
) -> list[dict[str, Any]]:
    rows = []
    for batch, hop, context, lookahead in WINDOWS:
        key = WindowKey(context, hop, lookahead)
        frames = torch.randint(0, 4096, (batch, key.frames, 7), device=device)
        seeds = torch.zeros(batch, dtype=torch.int64, device=device)
        starts = torch.full((batch,), 5, dtype=torch.int64, device=device)
        slots = torch.tensor([watermark.acquire() for _ in range(batch)], device=device)
        fresh = torch.zeros(batch, dtype=torch.bool, device=device)
        audio = decoder.decode(frames, seeds, starts, key)
        d = _best_s(device, decoder.decode, frames, seeds, starts, key)
        m = _best_s(device, watermark.mark, audio, slots, fresh)
        for s in slots.tolist():
            watermark.release(s)
        emitted_s = batch * hop * 2048 / 24_000
        rows.append({
            "batch": batch, "hop": hop, "context": context, "lookahead": lookahead,
            "decode_ms": d * 1e3, "mark_ms": m * 1e3, "mark_over_decode": m / d,
            "mark_ms_per_audio_s": m * 1e3 / emitted_s,
        })  # fmt: skip
    return rows


def _first_chunk_s(harness: WorkerHarness, codes: np.ndarray) -> float:
    """Seconds from the ingest of every stream's first window's frames to their PCM."""
    first = WindowPolicy(harness.cfg).first_window_frames
    sink = CollectingSink()
    svc = CodecService(harness.cfg, harness.engine, sink, gateways=1)
    t0 = time.perf_counter()
    svc.ingest(
        Record(RecordKind.CODES, s + 1, 0, memoryview(codes[s, :first].tobytes()))
        for s in range(codes.shape[0])
    )
    while sum(1 for r in sink.records if r[1] == RecordKind.PCM) < codes.shape[0]:
        if not svc.pump():
            time.sleep(0.0005)
    took = time.perf_counter() - t0
    for sid in list(svc.streams):  # the rest of these streams is not decoded
        end = record_encoder.encode(StreamEnd("cancelled", first))
        svc.ingest([Record(RecordKind.END, sid, first, memoryview(end))])
    while svc.pump():
        pass
    return took


def _timed(harness: WorkerHarness, codes: np.ndarray, lockstep: bool) -> dict[str, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    sink, batches, windows = harness.run(codes, lockstep)
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    audio = audio_seconds(sink)
    return {"wall_s": wall, "cpu_s": cpu, "audio_s": audio, "windows_per_batch": windows / batches}


def _seam_db(
    harness: WorkerHarness, watermark: StreamWatermark | None, decoder: WindowDecoder,
    codes: np.ndarray, seed: int,
) -> float:  # fmt: skip
    pcm = pcm_by_stream(harness.run(codes, lockstep=True)[0])
    frames = torch.from_numpy(codes.astype(np.int64)).to(harness.engine.device)
    seeds = torch.full((codes.shape[0],), decode_seed(seed), dtype=torch.int64)
    with torch.inference_mode():
        offline = decoder.decode_offline(frames, seeds.to(frames.device))
        if watermark is not None:
            slots = torch.tensor([watermark.acquire() for _ in range(codes.shape[0])])
            offline = watermark.mark(offline, slots.to(frames.device), slots > 0)
            for s in slots.tolist():
                watermark.release(s)
    ref = (offline * PCM_SCALE).round().cpu().numpy()
    return float(np.mean([error_db(pcm[s + 1], ref[s]) for s in range(codes.shape[0])]))


def watermark_ab(
    args: argparse.Namespace,
    decoder: WindowDecoder,
    cfg: CodecConfig,
    device: torch.device,
    levels: list[int],
    rng: np.random.Generator,
    header: dict[str, Any],
) -> int:
    watermark = load_watermark("perth", device)
    harness = {
        "off": WorkerHarness(decoder, cfg, device),
        "perth": WorkerHarness(decoder, cfg, device, watermark),
    }
    for h in harness.values():
        h.engine.warmup()
    rows: list[dict[str, Any]] = []
    for n in levels:
        codes = rng.integers(0, 4096, (n, args.frames, 7)).astype("<i2")
        acc: dict[str, dict[str, list[float]]] = {a: {} for a in ARMS}
        for rnd in range(args.rounds):
            for arm in ARMS if rnd % 2 == 0 else ARMS[::-1]:
                h = harness[arm]
                got: dict[str, float] = {"first_chunk_s": _first_chunk_s(h, codes)}
                for mode, lockstep in (("saturated", False), ("lockstep", True)):
                    for k, v in _timed(h, codes, lockstep).items():
                        got[f"{mode}_{k}"] = v
                for k, v in got.items():
                    acc[arm].setdefault(k, []).append(v)
        row: dict[str, Any] = {"streams": n}
        for arm in ARMS:
            a = acc[arm]
            for mode in ("saturated", "lockstep"):
                audio, wall = sum(a[f"{mode}_audio_s"]), sum(a[f"{mode}_wall_s"])
                row[f"{arm}_{mode}_audio_s_per_s"] = audio / wall
                row[f"{arm}_{mode}_cpu_s_per_audio_s"] = sum(a[f"{mode}_cpu_s"]) / audio
                row[f"{arm}_{mode}_windows_per_batch"] = statistics.mean(
                    a[f"{mode}_windows_per_batch"]
                )
            row[f"{arm}_first_chunk_ms"] = 1e3 * statistics.median(a["first_chunk_s"])
        rows.append(row)
        print(
            f"[{n} streams] saturated {row['off_saturated_audio_s_per_s']:.3f} -> "
            f"{row['perth_saturated_audio_s_per_s']:.3f} audio s/s, first chunk "
            f"{row['off_first_chunk_ms']:.1f} -> {row['perth_first_chunk_ms']:.1f} ms",
            flush=True,
        )
    seam_codes = rng.integers(0, 4096, (args.seam_streams, args.seam_frames, 7)).astype("<i2")
    seams = {
        "off": _seam_db(harness["off"], None, decoder, seam_codes, cfg.noise_seed),
        "perth": _seam_db(harness["perth"], watermark, decoder, seam_codes, cfg.noise_seed),
    }
    decoder.to(device)
    windows = _per_window(decoder, watermark, device)
    _print(rows, seams, windows)
    result = {
        "benchmark": "codec-watermark",
        **header,
        "device": str(device),
        "config": run_config(args, cfg),
        "levels": rows,
        "seam_db": seams,
        "per_window": windows,
        "note": "random weights: the decoded audio is noise, not speech",
    }
    write_json(result, args.json, announce=sys.stdout)
    return 0


def _print(
    rows: list[dict[str, Any]], seams: dict[str, float], windows: list[dict[str, Any]]
) -> None:
    columns = ("streams", "mode", "off audio s/s", "perth audio s/s", "perth / off",
               "off CPU s/audio s", "perth CPU s/audio s")  # fmt: skip
    out: list[tuple[str, ...] | None] = []
    for r in rows:
        n = r["streams"]
        for mode in ("saturated", "lockstep"):
            off, on = r[f"off_{mode}_audio_s_per_s"], r[f"perth_{mode}_audio_s_per_s"]
            out.append((
                str(n), mode, f"{off:.3f}", f"{on:.3f}", f"{on / off:.3f}",
                f"{r[f'off_{mode}_cpu_s_per_audio_s']:.3f}",
                f"{r[f'perth_{mode}_cpu_s_per_audio_s']:.3f}",
            ))  # fmt: skip
        out.append((
            str(n), "first chunk ms", f"{r['off_first_chunk_ms']:.1f}",
            f"{r['perth_first_chunk_ms']:.1f}",
            f"{r['perth_first_chunk_ms'] / r['off_first_chunk_ms']:.3f}", "", "",
        ))  # fmt: skip
        out.append(None)
    show(
        table("codec: watermark off vs perth (same codes, alternated)", columns, out),
        f"seams, streamed vs one offline pass: off {seams['off']:.1f} dB, "
        f"perth {seams['perth']:.1f} dB",
        "random weights: the decoded audio is noise, not speech",
    )
    columns = ("batch", "hop", "context", "lookahead", "decode ms", "mark ms", "mark / decode",
               "mark ms per audio s")  # fmt: skip
    wrows: list[tuple[str, ...] | None] = [
        (str(w["batch"]), str(w["hop"]), str(w["context"]), str(w["lookahead"]),
         f"{w['decode_ms']:.1f}", f"{w['mark_ms']:.1f}", f"{w['mark_over_decode']:.3f}",
         f"{w['mark_ms_per_audio_s']:.1f}")
        for w in windows
    ]  # fmt: skip
    show(table(f"per window, best of {REPS} calls", columns, wrows))
