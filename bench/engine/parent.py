"""The parent: K engine processes per variant started, stepped through the levels together
and stopped; their levels combined into the variant's result."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bench.engine.channel import Channel, board_name
from bench.engine.levels import combine, mean, shares
from bench.engine.probes import GpuBusy
from bench.engine.results import PHASES_ENV, EngineLevel, Level, VariantResult
from bench.engine.variants import engine_cores, not_applicable
from common.cpu_plan import VLLM_BIND_ENV
from common.mps import mps_active
from shm.ring import segment_path


def _child_argv(
    args: argparse.Namespace, variant: str, count: int, index: int, fd: int, cores: str
) -> list[str]:
    return [
        sys.executable, "-m", "bench.engine", "--model", args.model, "--device", args.device,
        "--streams", ",".join(map(str, args.streams)), "--steps", str(args.steps),
        "--tokens", str(args.tokens), "--warmup-steps", str(args.warmup_steps),
        "--lever-head", args.lever_head, "--run-variant", variant,
        "--engine-count", str(count), "--engine-index", str(index), "--control-fd", str(fd),
        "--cores", cores,
    ]  # fmt: skip


def _last_error_line(log: Path) -> str:
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return "no log"
    for line in reversed(lines):
        if "Error" in line or "error" in line:
            return line.strip()[-300:]
    return lines[-1].strip()[-300:] if lines else "no output"


def _end_session(proc: subprocess.Popen[bytes]) -> None:
    """Stop an engine's process group: SIGTERM, then SIGKILL after a grace period."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            continue
        break
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=1)
    # The prevented-token board of an engine that was killed (it closes it otherwise).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(board_name(proc.pid)))


@dataclass
class EngineProc:
    index: int
    proc: subprocess.Popen[bytes]
    channel: Channel
    log: Path
    ready: dict[str, Any] = field(default_factory=dict)


def _start_engine(
    args: argparse.Namespace, variant: str, count: int, index: int, work: Path, cores: str
) -> EngineProc:
    tag = f"{variant}-k{count}-e{index}"
    log = work / f"{tag}.log"
    env = dict(os.environ)
    if args.phase_timers:
        phases = work / f"phases-{tag}"
        phases.mkdir(parents=True, exist_ok=True)
        env[PHASES_ENV] = str(phases)
    if cores:
        env[VLLM_BIND_ENV] = cores
    parent, child = socket.socketpair()
    with log.open("wb") as f:
        # Its own session: whatever it leaves (vLLM's engine processes) goes with it.
        proc = subprocess.Popen(
            _child_argv(args, variant, count, index, child.fileno(), cores), stdout=f,
            stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(child.fileno(),),
            env=env,
        )  # fmt: skip
    child.close()
    return EngineProc(index, proc, Channel(parent, proc), log)


def run_group(args: argparse.Namespace, variant: str, count: int, work: Path) -> VariantResult:
    """``count`` engines of one variant, every level with at least one stream per engine."""
    reason = not_applicable(variant, args.device)
    if reason is not None:
        return VariantResult(variant, "skipped", reason=reason, engines=count)
    levels = [n for n in args.streams if n >= count]
    if not levels:
        return VariantResult(
            variant, "skipped", reason=f"no level has a stream for each of {count} engines",
            engines=count,
        )  # fmt: skip
    mps = mps_active() if args.device == "cuda" else None
    cores = [""] * count
    if args.device == "cpu" and count > 1 and VLLM_BIND_ENV not in os.environ:
        cores = engine_cores(os.sched_getaffinity(0), count)
    deadline = time.monotonic() + args.variant_timeout
    print(
        f"{variant}, {count} engine(s): starting (logs: {work}/{variant}-k{count}-e*.log"
        + (f"; MPS {'active' if mps else 'not active'})" if mps is not None else ")"),
        flush=True,
    )
    engines: list[EngineProc] = []
    gpu = GpuBusy(args.device)
    measured: list[Level] = []
    frontend: dict[str, float] = {}
    timers: str | None = None
    try:
        for i in range(count):
            engines.append(_start_engine(args, variant, count, i, work, cores[i]))
            if args.device == "cuda":  # vLLM's memory profiling: one engine at a time
                engines[-1].ready = engines[-1].channel.expect("ready", deadline)
        for e in engines:
            if not e.ready:
                e.ready = e.channel.expect("ready", deadline)
        for n in levels:
            for e, share in zip(engines, shares(n, count), strict=True):
                e.channel.send({"level": share})
            for e in engines:
                e.channel.expect("warm", deadline)
            gpu.start()
            for e in engines:
                e.channel.send({"go": True})
            for e in engines:
                e.channel.expect("reached", deadline)
            for e in engines:
                e.channel.send({"stop": True})
            busy = gpu.stop()
            parts = [
                msgspec.convert(e.channel.expect("result", deadline), EngineLevel) for e in engines
            ]
            level = combine(variant, parts, busy, mps)
            measured.append(level)
            frontend[str(n)] = round(mean([p.frontend_cpu_ms_per_step for p in parts]), 3)
            print(
                f"  {variant} K={count} N={n}: step p50 {level.step_ms_p50:.2f} ms (slowest "
                f"engine), p99 {level.step_ms_p99:.2f} ms, {level.tokens_per_s:.0f} tokens/s",
                flush=True,
            )
        for e in engines:
            e.channel.send({"quit": True})
        timers = engines[0].channel.expect("phase_timers", deadline) if args.phase_timers else None
        for e in engines[1:]:
            with contextlib.suppress(Exception):
                e.channel.expect("phase_timers", deadline)
        for e in engines:
            with contextlib.suppress(subprocess.TimeoutExpired):
                e.proc.wait(timeout=max(1.0, min(120.0, deadline - time.monotonic())))
    except Exception as e:
        first = " ".join(str(e).split())
        logs = ", ".join(str(x.log) for x in engines)
        line = f"{type(e).__name__}: {first}"[:300]
        # An engine that died or hung says why in its log, not over the channel.
        if engines and (not isinstance(e, RuntimeError) or "engine process" in first):
            dead = next((x for x in engines if x.proc.poll() is not None), engines[-1])
            line += f" ({_last_error_line(dead.log)})"
        print(f"{variant} K={count}: FAILED: {line} (logs: {logs})", flush=True)
        return VariantResult(
            variant, "failed", reason=line, engines=count, mps=mps, levels=measured,
            frontend_cpu_ms_per_step=frontend,
        )  # fmt: skip
    finally:
        gpu.close()
        for e in engines:
            with contextlib.suppress(OSError):
                e.channel.sock.close()
            _end_session(e.proc)
    first_ready = engines[0].ready
    return VariantResult(
        variant, "ok", engines=count, mps=mps, engine=first_ready.get("engine"),
        sampling=first_ready.get("sampling"), levels=measured,
        frontend_cpu_ms_per_step=frontend, phase_timers=timers,
    )  # fmt: skip
