"""``orpheus-serve bench jobs [--json FILE]``: interactive TTFB with long-form jobs running
beside it, and the jobs' throughput; the joins between units.

Processes: the synthetic source (``testkit.synthetic_backend``: plays the llm_worker and
codec_worker, real-time paced, with a fixed first-chunk delay), the gateway exactly as served
(``gateway.main.run``, with its job runner), and this process as the client. Each variant runs
a fresh gateway and jobs directory:

- ``no jobs``: interactive requests only, arriving at a fixed rate (Poisson, seeded);
- ``jobs, reserve R``: the same arrivals, with two long jobs running (``jobs.reserve_streams``
  = R, the default rule);
- ``jobs, reserve 0``: the same, with no reserve: what the reserve buys.

Per variant: the interactive p50/p99 TTFB measured at the client (request sent to first audio
byte), errors, the most streams jobs held (sampled from ``/metrics``), and the jobs' throughput
in audio seconds per second over the window. The synthetic source has no compute to share:
what this measures is the admission rule and the gateway's own cost of running jobs (its
event loop, the units' writes), not an engine's contention (docs/benchmarks.md, Jobs).

Then one short job is spoken to the end and its file's joins are measured: the largest sample
step within 2 samples of each join against the 99th percentile step inside the units (dB; at
most 0 means no click), and the quiet samples (under 1% of full scale) around each join (ms),
beside the same measure of the units joined raw (no fade): the synthetic tone is cut
mid-cycle at every unit's end, the worst case for a click.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

import aiohttp
import numpy as np

from bench.gateway.cpu import header
from bench.gateway.synthetic import SyntheticGateway
from bench.lib.report import show, table, write_json
from bench.lib.stats import percentile
from bench.load.clients import NO_STORE
from common.config import ServeConfig
from common.config.gateway import GatewayConfig
from common.config.jobs import JobsConfig
from shm.config import ShmConfig
from shm.records import SAMPLE_RATE, SAMPLES_PER_FRAME

BYTES_PER_S = SAMPLE_RATE * 2
TARGET_RATIO = 1.2
"""The goal: interactive p99 TTFB with jobs within 20% of without."""


async def _metric(s: aiohttp.ClientSession, base: str, name: str) -> float:
    async with s.get(f"{base}/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


async def _interactive(
    s: aiohttp.ClientSession, base: str, frames: int, rate: float, duration: float, seed: int
) -> tuple[list[float], int]:
    """Open-loop arrivals at ``rate`` per second for ``duration``: TTFBs (ms) and errors."""
    rng = np.random.default_rng(seed)
    body = {"model": "tts-1", "input": "Hello there.", "voice": "tara",
            "response_format": "pcm", "max_tokens": 7 * frames}  # fmt: skip
    ttfb: list[float] = []
    errors = 0

    async def one() -> None:
        nonlocal errors
        t0 = time.perf_counter()
        try:
            async with s.post(f"{base}/v1/audio/speech", json=body, headers=NO_STORE) as r:
                if r.status != 200:
                    errors += 1
                    await r.read()
                    return
                first = True
                async for chunk in r.content.iter_any():
                    if first and chunk:
                        ttfb.append(1000 * (time.perf_counter() - t0))
                        first = False
        except aiohttp.ClientError:
            errors += 1

    tasks = []
    end = time.perf_counter() + duration
    while (now := time.perf_counter()) < end:
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(min(float(rng.exponential(1 / rate)), end - now))
    await asyncio.gather(*tasks)
    return ttfb, errors


async def _job_audio_s(s: aiohttp.ClientSession, base: str, ids: list[str]) -> float:
    total = 0.0
    for job_id in ids:
        async with s.get(f"{base}/v1/audio/jobs/{job_id}") as r:
            total += (await r.json())["progress"]["audio_seconds"]
    return total


async def _variant(base: str, args: argparse.Namespace, jobs: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
        ids = []
        for j in range(jobs):
            # Each job's sentences its own: a job's units cannot opt out of the sentence
            # audio cache, which would answer a repeat of another job's.
            text = " ".join(f"Sentence {i} of bench chapter {j}." for i in range(args.job_units))
            body = {"input": text, "voice": "tara", "response_format": "pcm",
                    "max_tokens": 7 * args.unit_frames}  # fmt: skip
            async with s.post(f"{base}/v1/audio/jobs", json=body) as r:
                assert r.status == 202, await r.text()
                ids.append((await r.json())["id"])
        await asyncio.sleep(args.warmup)
        most = 0.0
        sampling = True

        async def sample() -> None:
            nonlocal most
            while sampling:
                most = max(most, await _metric(s, base, "orpheus_gateway_job_streams"))
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        audio0, units0 = (
            await _job_audio_s(s, base, ids),
            await _metric(s, base, "orpheus_gateway_job_units_total"),
        )
        t0 = time.perf_counter()
        ttfb, errors = await _interactive(
            s, base, args.request_frames, args.rate, args.duration, args.seed
        )
        window = time.perf_counter() - t0
        audio1, units1 = (
            await _job_audio_s(s, base, ids),
            await _metric(s, base, "orpheus_gateway_job_units_total"),
        )
        sampling = False
        await sampler
        for job_id in ids:
            async with s.delete(f"{base}/v1/audio/jobs/{job_id}") as r:
                await r.read()
    return {
        "requests": len(ttfb) + errors,
        "errors": errors,
        "ttfb_p50_ms": round(percentile(ttfb, 50), 2),
        "ttfb_p99_ms": round(percentile(ttfb, 99), 2),
        "job_streams_max": int(most),
        "job_units_per_s": round((units1 - units0) / window, 3),
        "job_audio_s_per_s": round((audio1 - audio0) / window, 3),
        "window_s": round(window, 2),
    }


def join_quality(pcm: np.ndarray, unit_samples: int) -> dict[str, float]:
    """Clicks and gaps at the joins of equal units (see the module docstring)."""
    x = pcm.astype(np.float64)
    steps = np.abs(np.diff(x))
    joins = np.arange(unit_samples, x.size, unit_samples)
    inside = np.ones(steps.size, dtype=bool)
    for j in joins:
        inside[max(0, j - 3) : j + 2] = False
    ref = percentile(steps[inside].tolist(), 99)
    worst = max(float(steps[max(0, j - 3) : j + 2].max()) for j in joins)
    quiet = [
        float(np.count_nonzero(np.abs(x[max(0, j - 480) : j + 480]) < 0.01 * 32768)) for j in joins
    ]
    return {
        "joins": len(joins),
        "click_db": round(float(20 * np.log10(max(worst, 1e-9) / ref)), 2),
        "quiet_ms_per_join": round(1000 * float(np.mean(quiet)) / SAMPLE_RATE, 3),
    }


async def _joins(base: str, args: argparse.Namespace) -> dict[str, Any]:
    from testkit.synthetic_backend import synthetic_pcm

    units = 12
    text = " ".join(f"Join test sentence {i}." for i in range(units))
    frames = args.unit_frames
    async with aiohttp.ClientSession() as s:
        body = {"input": text, "voice": "tara", "response_format": "pcm", "max_tokens": 7 * frames}
        async with s.post(f"{base}/v1/audio/jobs", json=body) as r:
            job_id = (await r.json())["id"]
        deadline = time.monotonic() + 120
        while True:
            async with s.get(f"{base}/v1/audio/jobs/{job_id}") as r:
                state = (await r.json())["state"]
            if state in ("done", "failed", "cancelled"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the join test's job did not finish in 120 s")
            await asyncio.sleep(0.1)
        async with s.get(f"{base}/v1/audio/jobs/{job_id}/audio") as r:
            data = await r.read()
    n = frames * SAMPLES_PER_FRAME
    joined = np.frombuffer(data, dtype="<i2")
    unit = np.concatenate(
        [synthetic_pcm(f * SAMPLES_PER_FRAME, SAMPLES_PER_FRAME) for f in range(frames)]
    )
    raw = np.tile(unit, units)
    return {"state": state, "faded": join_quality(joined, n), "raw": join_quality(raw, n)}


def _serve(args: argparse.Namespace, reserve: int | None) -> SyntheticGateway:
    """A source and a gateway (with a jobs dir of its own); ``reserve`` None: default."""

    def configure(shm: ShmConfig, port: int, run_dir: str) -> ServeConfig:
        jobs = JobsConfig(
            dir=os.path.join(run_dir, "jobs"),
            reserve_streams=JobsConfig().reserve_streams if reserve is None else reserve,
            streams_per_job=args.streams_per_job,
        )
        return ServeConfig(
            device="cpu", log_level="WARNING", shm=shm, jobs=jobs,
            # A fixed count: the synthetic backend's pace is set here, not by the load.
            gateway=GatewayConfig(port=port, max_active_streams=args.max_active,
                                  max_queued_streams=256, playground=False, admission="fixed"),
        )  # fmt: skip

    return SyntheticGateway(configure, first_chunk_delay_s=args.first_chunk_ms / 1000, tick_s=0.005)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orpheus-serve bench jobs", description=__doc__)
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--duration", type=float, default=20.0, help="measured seconds per variant")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds jobs run before measuring")
    ap.add_argument("--rate", type=float, default=4.0, help="interactive requests per second")
    ap.add_argument("--request-frames", type=int, default=12, help="frames (85 ms) per request")
    ap.add_argument("--unit-frames", type=int, default=12, help="frames per job unit")
    ap.add_argument("--job-units", type=int, default=2000, help="units of each long job")
    ap.add_argument("--jobs", type=int, default=2, help="long jobs running at once")
    ap.add_argument("--streams-per-job", type=int, default=8)
    ap.add_argument("--max-active", type=int, default=16, help="gateway.max_active_streams")
    ap.add_argument("--first-chunk-ms", type=float, default=100.0, help="the source's delay")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    reserve = JobsConfig().reserve_streams
    variants = [("no jobs", None, 0), (f"jobs, reserve {reserve}", None, args.jobs),
                ("jobs, reserve 0", 0, args.jobs)]  # fmt: skip
    env = header()
    results: dict[str, dict[str, Any]] = {}
    joins: dict[str, Any] = {}
    for name, res, n_jobs in variants:
        print(f"variant {name} ...", file=sys.stderr, flush=True)
        with _serve(args, res) as served:
            results[name] = asyncio.run(_variant(served.url, args, n_jobs))
            if name == "no jobs":
                joins = asyncio.run(_joins(served.url, args))
    base_p99 = results["no jobs"]["ttfb_p99_ms"]
    for r in results.values():
        r["p99_vs_no_jobs"] = round(r["ttfb_p99_ms"] / base_p99, 3) if base_p99 else None
    rows = [
        (name, str(r["requests"]), str(r["errors"]), f"{r['ttfb_p50_ms']:.1f}",
         f"{r['ttfb_p99_ms']:.1f}", f"{r['p99_vs_no_jobs']:.2f}", str(r["job_streams_max"]),
         f"{r['job_units_per_s']:.2f}", f"{r['job_audio_s_per_s']:.2f}")
        for name, r in results.items()
    ]  # fmt: skip
    title = (
        f"interactive TTFB at {args.rate:g} req/s ({args.request_frames} frames each) beside "
        f"{args.jobs} long jobs; max_active {args.max_active}; synthetic backend"
    )
    cols = ("variant", "requests", "errors", "TTFB p50 ms", "TTFB p99 ms", "p99 / no jobs",
            "job streams max", "units/s", "job audio s/s")  # fmt: skip
    join_rows = [
        (kind, str(q["joins"]), f"{q['click_db']:.1f}", f"{q['quiet_ms_per_join']:.2f}")
        for kind, q in (
            ("units as written (faded)", joins["faded"]),
            ("raw (no fade)", joins["raw"]),
        )
    ]
    show(
        table(title, cols, rows, left={"variant"}),
        table("joins between units (click dB: <= 0 is no click)",
              ("audio", "joins", "click dB", "quiet ms/join"), join_rows, left={"audio"}),
        min_width=130,
    )  # fmt: skip
    with_jobs = results[f"jobs, reserve {reserve}"]
    verdict = (
        with_jobs["p99_vs_no_jobs"] is not None and with_jobs["p99_vs_no_jobs"] <= TARGET_RATIO
    )
    print(f"goal (p99 with jobs within 20% of without): {'met' if verdict else 'NOT met'}")
    write_json(
        {**env, "backend": "synthetic (testkit.synthetic_backend, real-time paced)",
         "args": vars(args), "variants": results, "joins": joins, "goal_met": verdict},
        args.json, announce=sys.stderr,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
