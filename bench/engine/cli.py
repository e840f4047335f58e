"""``orpheus-serve bench engine``: the engine alone, as a curve of step time against streams,
with one engine or several sharing the device.

Each engine is built exactly as the llm worker builds it: :func:`llm_worker.engine.plan.
plan_engine` (model runner, sampling processors, output head), then :meth:`llm_worker.engine.engine.
GenerationEngine.start` (the server's ``engine_args``: same model, runner, output head,
stats, prefix cache), from the server's own configuration for ``--device`` (the CPU
profile on ``cpu``), in a process of its own (as the server's llm workers are). Nothing else
runs: no gateway, no codec, no ring.

For each ``--engines`` count K and each ``--streams`` level N (the total over the engines), K
engine processes each keep N/K fixed-length requests in their engine, in a closed loop
(``min_tokens = max_tokens = --tokens``, built like the worker's: :func:`llm_worker.requests.
segment_params` with the voice's sampling and the sampling package's arguments; prompts from
:class:`llm_worker.prompt.PromptBuilder`). A finished request is replaced at once by the next.
Starts are staggered: the first wave's request i asks for ``tokens * (i + 1) / n`` tokens, so
requests end (and new prompts arrive) evenly from the first step on, and after
``--warmup-steps`` (default: ``--tokens``, one whole generation) the contexts are spread
evenly over 0..tokens, as in steady traffic. When every engine has warmed up, all are
measured over one window, which ends once each has run ``--steps`` steps:

- step time p50 / p99 (ms), per engine: intervals between the engine's step signals (the
  worker's own step hook), i.e. the period at which each of its streams gets a token; a
  level's own p50 / p99 are its slowest engine's (its streams set the pace of real time);
- tokens/s: tokens delivered in the window over its length, summed over the engines;
- engine-core CPU ms per step, per engine: user + system CPU of that engine's vLLM
  EngineCore process (psutil) over the window, per step (on CPU the forward pass runs in a
  worker process beside it); the level's figure is the engines' mean;
- GPU busy fraction (CUDA only, NVML utilisation samples over the window; null on CPU);
- per-phase host time in the engine core, µs per request-step (``--phase-timers``, on by
  default: :mod:`llm_worker.vllm_ext.phase_timers`, loaded into vLLM's processes by the project's vLLM
  plugin): ``schedule``, ``update_from_output``, the model runner's state update, input
  preparation and output bookkeeping, and the output serialisation.

Sharing the device: on CUDA each engine gets ``gpu_memory_utilization / K`` (and
``kv_cache_memory_bytes / K`` where set), and the engines start one after another (vLLM's
memory profiling reads the device's free memory); whether CUDA MPS is active is recorded
(:func:`common.mps.mps_active`; this benchmark never starts the MPS daemon: the GPU plan
does, scripts/gpu/run_capacity.sh). On CPU the engines start at once, and with K > 1 each
engine's processes are pinned to its share of the cores (``VLLM_CPU_OMP_THREADS_BIND``).

Variants (``--variants``), each K engine starts running every level: ``full-head`` (the
whole vocabulary), ``audio-head`` (``llm.output_head = audio``), ``top-p-off`` (top_p 1.0),
``prefix-cache-off``, ``stats-off`` (``llm.engine_stats = false``), ``kv-fp8`` (CUDA only).
The last four change one thing from ``full-head``. A variant that cannot apply here is
reported as skipped, one that fails as failed (one line each); the others go on. Prints a
table (and one of the phases), and writes ``--json`` (a ``levels`` list: one entry per
variant, K and N, with ``engines`` and ``per_engine``) and ``--png`` (t(N) and tokens/s per
variant and K, with the 11.5 ms real-time line).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine.child import engine_main
from bench.engine.parent import run_group
from bench.engine.report import plot, print_table
from bench.engine.results import (
    DEFAULT_STEPS,
    DEFAULT_TOKENS,
    STREAMS,
    VARIANT_NAMES,
    VARIANT_TIMEOUT_S,
)
from bench.engine.variants import parse_engines, parse_streams, parse_variants, plugin_registered
from bench.lib.report import environment, write_json
from common.mps import mps_active, pipe_directory


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench engine", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="Orpheus checkpoint (default: the tiny model, in a temp dir)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--streams", default=",".join(map(str, STREAMS)),
                   help="total streams per level (over all engines), e.g. 16,64")  # fmt: skip
    p.add_argument("--engines", default="1",
                   help="engine counts K sharing the device, e.g. 1,2,3: each level's streams "
                   "are split over K engine processes, measured over one window")  # fmt: skip
    p.add_argument("--steps", type=int, help="measured steps per level (default 300 cuda, 60 cpu)")
    p.add_argument("--tokens", type=int, help="tokens per request (default 840 cuda, 48 cpu)")
    p.add_argument("--warmup-steps", type=int, help="steps before measuring (default --tokens)")
    p.add_argument("--variants", default="full-head", help=", ".join(VARIANT_NAMES))
    p.add_argument("--lever-head", choices=["full", "audio"], default="full",
                   help="the head the lever variants (top-p-off ... kv-fp8) run")  # fmt: skip
    p.add_argument("--phase-timers", action=argparse.BooleanOptionalAction, default=True,
                   help="time the engine core's phases (µs per request-step; "
                   "llm_worker.vllm_ext.phase_timers, through the project's vLLM plugin)")  # fmt: skip
    p.add_argument("--mps", action="store_true",
                   help="CUDA, K > 1: refuse to run unless the CUDA MPS control daemon is "
                   "active (common.mps). This benchmark never starts it: the GPU plan does "
                   "(scripts/gpu/run_capacity.sh); without the flag MPS is only recorded")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, help="plot t(N) and tokens/s per variant and K here")
    p.add_argument("--variant-timeout", type=int, default=VARIANT_TIMEOUT_S,
                   help="seconds one variant and K (engine starts and all levels) may take")  # fmt: skip
    p.add_argument("--run-variant", help=argparse.SUPPRESS)
    p.add_argument("--engine-count", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--engine-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--control-fd", type=int, help=argparse.SUPPRESS)
    p.add_argument("--cores", default="", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.streams = parse_streams(args.streams)
        args.engines = parse_engines(args.engines)
        variants = parse_variants(args.variants)
    except ValueError as e:
        p.error(str(e))
    if args.tokens is None:
        args.tokens = DEFAULT_TOKENS[args.device]
    if args.steps is None:
        args.steps = DEFAULT_STEPS[args.device]
    if args.warmup_steps is None:
        args.warmup_steps = args.tokens
    if args.steps < 2 or args.tokens < 1:
        p.error("--steps must be >= 2 and --tokens >= 1")
    if args.control_fd is not None:
        return engine_main(args)
    mps = mps_active() if args.device == "cuda" else None
    if args.mps and args.device == "cuda" and max(args.engines) > 1 and not mps:
        p.error(
            f"--mps: no CUDA MPS control daemon at {pipe_directory()} (start it with "
            "nvidia-cuda-mps-control -d, with the same CUDA_MPS_PIPE_DIRECTORY)"
        )
    if args.phase_timers and not plugin_registered():
        print(
            "phase timers: the project's vLLM plugin is not registered here (fix: pip install "
            "-e .); no phases will be measured",
            file=sys.stderr,
        )

    # SIGTERM (a timeout, a supervisor) ends the run through the finally blocks that stop
    # the engines' processes.
    signal.signal(signal.SIGTERM, _terminated)
    with tempfile.TemporaryDirectory(prefix="orpheus-bench-engine-") as tmp:
        work = Path(tmp)
        if args.model is None:
            from testkit.tiny_model import write_tiny_model

            write_tiny_model(work / "model")
            args.model = str(work / "model")
        t0 = time.monotonic()
        results = [run_group(args, v, k, work) for v in variants for k in args.engines]
        elapsed = time.monotonic() - t0
        print_table(results, args.streams)
        env = environment()
        doc = {
            "benchmark": "engine",
            "machine": env["machine"],
            "versions": env["versions"],
            "commit": env["versions"]["git_commit"],
            "load_average": os.getloadavg(),
            "config": {
                "model": args.model,
                "device": args.device,
                "streams": args.streams,
                "engines": args.engines,
                "steps": args.steps,
                "tokens": args.tokens,
                "warmup_steps": args.warmup_steps,
                "variants": variants,
                "lever_head": args.lever_head,
                "phase_timers": args.phase_timers,
                "mps": mps,
                "mps_pipe_directory": pipe_directory() if mps is not None else None,
                "elapsed_s": round(elapsed, 1),
                "step_time": "intervals between the worker's step signals (closed loop); "
                "with K engines, a level's step times are its slowest engine's",
            },
            "variants": [
                {
                    "variant": r.variant,
                    "engines": r.engines,
                    "status": r.status,
                    "reason": r.reason,
                    "mps": r.mps,
                    "engine": r.engine,
                    "sampling": r.sampling,
                    "frontend_cpu_ms_per_step": r.frontend_cpu_ms_per_step,
                    "phase_timers": r.phase_timers,
                }
                for r in results
            ],
            "levels": [lv for r in results for lv in r.levels],
        }
        write_json(doc, args.json, announce=sys.stdout)
        if args.png is not None:
            plot(
                results, args.png, f"engine step time, {args.device}, {args.tokens}-token requests"
            )
            print(f"wrote {args.png}")
    return 0 if any(r.status == "ok" for r in results) else 1
