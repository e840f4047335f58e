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
import asyncio
import contextlib
import itertools
import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from bench.lib.plot import pyplot, save
from bench.lib.report import environment, show, table, write_json
from bench.lib.stats import percentile
from bench.lockstep import TEXTS
from common.cpu_plan import VLLM_BIND_ENV, CpuPlan
from common.mps import mps_active, pipe_directory
from shm.layout import pid_alive
from shm.ring import segment_path

REAL_TIME_STEP_MS = 11.5
"""The step time real-time streaming of ~10 s utterances needs at p99 (docs/performance.md)."""
STREAMS = (16, 64, 256)
VARIANT_NAMES = (
    "full-head", "audio-head", "top-p-off", "prefix-cache-off", "stats-off", "kv-fp8",
)  # fmt: skip
DEFAULT_TOKENS = {"cuda": 840, "cpu": 48}
"""Tokens per request: 840 is 120 frames, ~10 s of audio. The CPU defaults (tokens, steps)
keep a run within minutes: there a step at 256 streams takes about a second (vLLM's CPU
top-p sorts the whole vocabulary per row)."""
DEFAULT_STEPS = {"cuda": 300, "cpu": 60}
PROMPT_ROOM = 128
MIN_MODEL_LEN = 256
VARIANT_TIMEOUT_S = 3600
MAX_ENGINES = 8
PHASES_ENV = "ORPHEUS_PROFILE_PHASES"
"""llm_worker.vllm_ext.phase_timers.ENV: the directory an engine's processes write their phases to."""
PHASE_ORDER = (
    "schedule", "update_from_output", "runner_update_states", "runner_prepare_inputs",
    "runner_bookkeeping", "serialize",
)  # fmt: skip


class EngineLevel(msgspec.Struct, frozen=True):
    """One engine's share of a measured level."""

    engine: int
    streams: int
    steps: int
    """Step intervals in the window (at least ``--steps``)."""
    step_ms_p50: float
    step_ms_p99: float
    engine_cpu_ms_per_step: float | None
    tokens: int
    tokens_per_s: float
    frontend_cpu_ms_per_step: float
    """This engine's own process (vLLM's output processor, the closed loop) per step."""
    phases_us_per_request_step: dict[str, float] | None = None
    requests_per_step: dict[str, float] | None = None
    """The mean batch each phase counter saw (``scheduler``, ``runner``)."""


class Level(msgspec.Struct, frozen=True):
    """One measured level: the JSON's ``levels`` entries. The first seven fields are those
    of a single-engine run before the engines dimension existed; with K > 1, the step times
    are the slowest engine's, the CPU the engines' mean, tokens/s their sum."""

    variant: str
    streams: int
    step_ms_p50: float
    step_ms_p99: float
    engine_cpu_ms_per_step: float | None
    gpu_busy_fraction: float | None
    tokens_per_s: float
    engines: int = 1
    mps: bool | None = None
    """CUDA: whether the MPS control daemon was active (common.mps); None on CPU."""
    per_engine: list[EngineLevel] = []
    phases_us_per_request_step: dict[str, float] | None = None
    """The engines' mean µs per request-step by phase (None: timers off or not loaded)."""


class VariantResult(msgspec.Struct, frozen=True):
    variant: str
    status: str
    """``ok``, ``failed`` or ``skipped``."""
    reason: str | None = None
    engines: int = 1
    mps: bool | None = None
    engine: str | None = None
    sampling: str | None = None
    levels: list[Level] = []
    frontend_cpu_ms_per_step: dict[str, float] = {}
    """The engine processes' own CPU (vLLM's output processor, the closed loop) per step,
    by streams (the engines' mean)."""
    phase_timers: str | None = None
    """Which vLLM methods were timed and which were not found (one line)."""


# -- statistics (pure) -----------------------------------------------------------------------


def intervals_ms(stamps: Sequence[float]) -> list[float]:
    """Milliseconds between consecutive step signals (``stamps`` in seconds)."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


def first_wave_lengths(streams: int, tokens: int) -> list[int]:
    """Token counts of the first wave's requests: ``tokens * (i + 1) / streams``, at least 1,
    so that they end one after another over one generation's length."""
    return [max(1, math.ceil(tokens * (i + 1) / streams)) for i in range(streams)]


def shares(streams: int, engines: int) -> list[int]:
    """How ``streams`` split over ``engines``: as evenly as possible, the first ones get the
    remainder."""
    if engines < 1 or streams < engines:
        raise ValueError(f"{streams} streams cannot give each of {engines} engines one")
    q, r = divmod(streams, engines)
    return [q + (1 if i < r else 0) for i in range(engines)]


def summarize_engine(
    engine: int,
    streams: int,
    stamps: Sequence[float],
    tokens: int,
    wall_s: float,
    engine_cpu_s: float | None,
    frontend_cpu_s: float,
    phases: tuple[dict[str, float], dict[str, float]] | None = None,
) -> EngineLevel:
    """One engine's share of a level: its step signals' times in the window, the tokens it
    delivered in the window (``wall_s`` long) and the CPU seconds its processes used."""
    steps = intervals_ms(stamps)
    if not steps:
        raise ValueError("a level needs at least two step signals")
    return EngineLevel(
        engine=engine,
        streams=streams,
        steps=len(steps),
        step_ms_p50=round(percentile(steps, 50), 3),
        step_ms_p99=round(percentile(steps, 99), 3),
        engine_cpu_ms_per_step=(
            None if engine_cpu_s is None else round(engine_cpu_s * 1e3 / len(steps), 3)
        ),
        tokens=tokens,
        tokens_per_s=round(tokens / wall_s, 1) if wall_s > 0 else 0.0,
        frontend_cpu_ms_per_step=round(frontend_cpu_s * 1e3 / len(steps), 3),
        phases_us_per_request_step=(phases[0] or None) if phases else None,
        requests_per_step=(phases[1] or None) if phases else None,
    )


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def combine(
    variant: str, engines: Sequence[EngineLevel], gpu_busy: float | None, mps: bool | None
) -> Level:
    """A level from its engines' shares: the slowest engine's step times, the mean engine
    core CPU per step, the summed tokens/s, the mean µs per request-step of each phase that
    every engine reported."""
    if not engines:
        raise ValueError("a level needs at least one engine")
    cpu = [e.engine_cpu_ms_per_step for e in engines]
    phases: dict[str, float] | None = None
    tables = [e.phases_us_per_request_step for e in engines]
    if all(tables):
        common = set.intersection(*(set(t) for t in tables if t))
        phases = {
            p: round(_mean([t[p] for t in tables if t]), 3) for p in sorted(common, key=_phase_key)
        }
    return Level(
        variant=variant,
        streams=sum(e.streams for e in engines),
        step_ms_p50=max(e.step_ms_p50 for e in engines),
        step_ms_p99=max(e.step_ms_p99 for e in engines),
        engine_cpu_ms_per_step=(
            None if any(c is None for c in cpu) else round(_mean([c or 0.0 for c in cpu]), 3)
        ),
        gpu_busy_fraction=None if gpu_busy is None else round(gpu_busy, 3),
        tokens_per_s=round(sum(e.tokens_per_s for e in engines), 1),
        engines=len(engines),
        mps=mps,
        per_engine=list(engines),
        phases_us_per_request_step=phases,
    )


def _phase_key(name: str) -> tuple[int, str]:
    return (PHASE_ORDER.index(name) if name in PHASE_ORDER else len(PHASE_ORDER), name)


# -- the variants ----------------------------------------------------------------------------


def variant_overrides(name: str, lever_head: str = "full") -> dict[str, Any]:
    """The ``[llm]`` settings a variant changes (on top of the device's profile); the lever
    variants (all but the two heads) change one thing from ``lever_head``."""
    base: dict[str, Any] = {"output_head": lever_head}
    if name == "full-head":
        return {"output_head": "full"}
    if name == "audio-head":
        return {"output_head": "audio"}
    if name == "top-p-off":
        return {**base, "sampling": {"top_p": 1.0}}
    if name == "prefix-cache-off":
        return {**base, "enable_prefix_caching": False}
    if name == "stats-off":
        return {**base, "engine_stats": False}
    if name == "kv-fp8":
        return {**base, "kv_cache_dtype": "fp8"}
    raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANT_NAMES)})")


def not_applicable(name: str, device: str) -> str | None:
    """Why a variant cannot run here (None: it can)."""
    if name == "kv-fp8" and device != "cuda":
        return "the fp8 KV cache is measured on CUDA only"
    return None


def engine_config(args: argparse.Namespace, variant: str, max_num_seqs: int) -> Any:
    """The server's ``LLMConfig`` of one of ``args.engine_count`` engines sharing the device:
    ``llm.engines`` is K, so ``llm_worker.engine.args.engine_args`` gives it its share as it does
    in the server (on CUDA ``gpu_memory_utilization / K``, and ``kv_cache_memory_bytes / K``
    where set; on CPU the KV cache follows its own ``max_num_seqs``)."""
    from orchestrator.settings import load_config

    llm: dict[str, Any] = {
        "model": args.model,
        "engines": args.engine_count,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max(MIN_MODEL_LEN, args.tokens + PROMPT_ROOM),
        **variant_overrides(variant, args.lever_head),
    }
    return load_config(None, {"device": args.device, "llm": llm}).llm


def engine_cores(cores: Sequence[int], engines: int) -> list[str]:
    """Each engine's cores on CPU (``VLLM_CPU_OMP_THREADS_BIND``): the server's split of its
    engine cores (``common.cpu_plan``), here over every core this benchmark may use (there is
    no codec or gateway to keep cores for)."""
    plan = CpuPlan(engine=tuple(sorted(cores)), others=(), engines=engines)
    return [",".join(map(str, plan.engine_cores(e))) for e in range(engines)]


def check_head(variant: str, head: Any, lever_head: str = "full") -> None:
    """Raise where the head the engine will run is not the one the variant names."""
    from llm_worker.vllm_ext.token_space import HeadKind

    name = {"audio-head": "audio", "full-head": "full"}.get(variant, lever_head)
    want = HeadKind.AUDIO if name == "audio" else HeadKind.FULL
    if head.space.kind is not want:
        raise RuntimeError(f"{variant}: the engine would run {head.describe()}")
    if want is HeadKind.AUDIO and not plugin_registered():
        raise RuntimeError(
            "the audio head's vLLM plugin is not registered in this environment (entry point "
            "vllm.general_plugins, llm_worker.vllm_ext.plugin:register); fix: reinstall the "
            "project (pip install -e .)"
        )


def plugin_registered() -> bool:
    """Whether vLLM will load the project's plugin (audio head, phase timers)."""
    plugins = {e.value for e in metadata.entry_points(group="vllm.general_plugins")}
    return "llm_worker.vllm_ext.plugin:register" in plugins


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        variant_overrides(v)  # raises for an unknown name
    if len(set(names)) != len(names):
        raise ValueError(f"a variant is named twice in {text!r}")
    return names


def parse_streams(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--streams takes comma-separated integers, not {text!r}") from None
    if not levels or min(levels) < 1:
        raise ValueError("--streams needs at least one level, each >= 1")
    return levels


def parse_engines(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--engines takes comma-separated integers, not {text!r}") from None
    if not counts or min(counts) < 1 or max(counts) > MAX_ENGINES:
        raise ValueError(f"--engines needs at least one count, each in 1..{MAX_ENGINES}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"an engine count is named twice in {text!r}")
    return counts


# -- measurement helpers -----------------------------------------------------------------------


def engine_core_process() -> Any:
    """vLLM's EngineCore process (a child of this one), or None (in-process engine)."""
    import psutil

    me = psutil.Process()
    children = me.children(recursive=True)
    for p in children:
        with contextlib.suppress(psutil.Error):
            if "EngineCore" in p.name() or any("EngineCore" in a for a in p.cmdline()):
                return p
    return None


def cpu_seconds(proc: Any) -> float:
    t = proc.cpu_times()
    return float(t.user + t.system)


class GpuBusy:
    """The fraction of time a kernel ran on GPU 0 over a window (NVML utilisation samples);
    None where there is no NVML (the CPU build, no pynvml)."""

    def __init__(self, device: str) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        self._since_us = 0
        if device != "cuda":
            return
        try:
            import pynvml  # nvidia-ml-py, which vLLM's CUDA build brings

            pynvml.nvmlInit()
            index = int((os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0])
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception as e:  # no NVML: the fraction is unknown, not an error
            print(f"GPU busy fraction unavailable: {type(e).__name__}: {e}", file=sys.stderr)

    def start(self) -> None:
        self._since_us = int(time.time() * 1e6)

    def stop(self) -> float | None:
        if self._nvml is None:
            return None
        nv = self._nvml
        try:
            _, samples = nv.nvmlDeviceGetSamples(
                self._handle, nv.NVML_GPU_UTILIZATION_SAMPLES, self._since_us
            )
            values = [s.sampleValue.uiVal for s in samples if s.timeStamp >= self._since_us]
            if values:
                return sum(values) / len(values) / 100.0
            return nv.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        except Exception:
            return None

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(Exception):
                self._nvml.nvmlShutdown()


class PhaseReader:
    """The per-phase totals an engine's vLLM processes write (llm_worker.vllm_ext.phase_timers)."""

    FRESH_TIMEOUT_S = 3.0
    """How long :meth:`stop` waits for every process's totals to be written after the window."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._before: dict[int, dict[str, Any]] = {}

    def _read(self) -> dict[int, dict[str, Any]]:
        if self.directory is None:
            return {}
        from llm_worker.vllm_ext.phase_timers import read_snapshots

        return read_snapshots(self.directory)

    def start(self) -> None:
        self._before = self._read()

    def _read_after(self, mark: float) -> dict[int, dict[str, Any]]:
        """Snapshots each written at or after ``mark`` (wall time), by every live process
        that wrote one before. Each process writes every ``WRITE_INTERVAL_S`` from its own
        thread, so a read at the window's end can hold a file from before its start (a busy
        engine core's writer thread waits for the GIL): a phase would then look idle. Waits
        at most ``FRESH_TIMEOUT_S``; a process that has not written by then is read as is."""
        deadline = time.monotonic() + self.FRESH_TIMEOUT_S
        while True:
            snaps = self._read()
            stale = [
                pid
                for pid, snap in snaps.items()
                if snap.get("time", 0.0) < mark and pid_alive(pid)
            ]
            if not stale or time.monotonic() >= deadline:
                return snaps
            time.sleep(0.05)

    def stop(self) -> tuple[dict[str, float], dict[str, float]] | None:
        if self.directory is None:
            return None
        from llm_worker.vllm_ext.phase_timers import us_per_request_step

        phases, batch = us_per_request_step(self._before, self._read_after(time.time()))
        return dict(sorted(phases.items(), key=lambda kv: _phase_key(kv[0]))), batch

    def describe(self) -> str | None:
        """Which methods were wrapped and which the installed vLLM lacks (one line)."""
        snaps = self._read()
        if self.directory is None:
            return None
        if not snaps:
            return "no timers file appeared (is the project's vLLM plugin loaded?)"
        installed = sorted({m for s in snaps.values() for m in s.get("installed", [])})
        missing = sorted({m for s in snaps.values() for m in s.get("missing", [])} - set(installed))
        return f"timed: {', '.join(installed)}; not in this vLLM: {', '.join(missing) or '-'}"


# -- the closed loop ---------------------------------------------------------------------------


@dataclass
class Loop:
    """N streams, each one request at a time, replaced as it finishes; every step signal is
    timestamped and wakes the pump, which reads every collector (like the worker's)."""

    engine: Any
    make_params: Any
    prompts: list[list[int]]
    streams: int
    tokens: int
    stamps: list[float] = field(default_factory=list)
    delivered: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    _collectors: list[Any] = field(default_factory=list)
    """Each stream's current request's output collector (None before its first)."""
    _rids: list[str] = field(default_factory=list)
    _next: int = 0

    def on_step(self) -> None:
        self.stamps.append(time.perf_counter())
        self.wake.set()

    async def _start(self, i: int, tokens: int) -> None:
        self._next += 1
        rid = f"s{self.streams}-{i}-{self._next}"
        prompt = self.prompts[self._next % len(self.prompts)]
        collector = await self.engine.add(rid, prompt, self.make_params(len(prompt), tokens))
        self._collectors[i] = collector
        self._rids[i] = rid

    async def fill(self) -> None:
        self._collectors = [None] * self.streams
        self._rids = [""] * self.streams
        for i, n in enumerate(first_wave_lengths(self.streams, self.tokens)):
            await self._start(i, n)

    async def pump(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            for i, c in enumerate(self._collectors):
                out = c.get_nowait() if c is not None else None
                if out is None:
                    continue
                self.delivered += len(out.outputs[0].token_ids)
                if out.finished:
                    await self._start(i, self.tokens)

    async def wait_steps(self, n: int, pump: asyncio.Task[None]) -> None:
        """Until ``n`` more steps were signalled (raises what ended the pump, if it ended)."""
        await self.wait_until(len(self.stamps) + n, pump)

    async def wait_until(self, count: int, pump: asyncio.Task[None]) -> None:
        while len(self.stamps) < count:
            if pump.done():
                pump.result()
                raise RuntimeError("the closed loop's pump stopped")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.engine.llm.abort([r for r in self._rids if r])
        await asyncio.sleep(0.5)


# -- the control channel between the parent and each engine process -------------------------
#
# One JSON object a line over a socketpair. The parent: {"level": n}, {"go": true},
# {"stop": true}, {"quit": true}. An engine: {"ready": {...}}, {"warm": true},
# {"reached": true}, {"result": EngineLevel}, {"error": "one line"}.


class Channel:
    """The parent's end: blocking, with a deadline, watching the engine's process."""

    def __init__(self, sock: socket.socket, proc: subprocess.Popen[bytes]) -> None:
        self.sock = sock
        self.proc = proc
        self._buf = b""

    def send(self, msg: dict[str, Any]) -> None:
        self.sock.sendall(msgspec.json.encode(msg) + b"\n")

    def recv(self, deadline: float) -> dict[str, Any]:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the engine process in time")
            ready, _, _ = select.select([self.sock], [], [], min(left, 1.0))
            if not ready:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the engine process exited ({self.proc.returncode})")
                continue
            chunk = self.sock.recv(1 << 16)
            if not chunk:
                raise RuntimeError(f"the engine process closed its channel ({self.proc.poll()})")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        msg = msgspec.json.decode(line)
        if "error" in msg:
            raise RuntimeError(str(msg["error"]))
        return msg

    def expect(self, key: str, deadline: float) -> Any:
        msg = self.recv(deadline)
        if key not in msg:
            raise RuntimeError(f"the engine process said {msg!r}, expected {key!r}")
        return msg[key]


class EngineSide:
    """The engine process's end (asyncio)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, fd: int) -> EngineSide:
        sock = socket.socket(fileno=fd)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    async def send(self, msg: dict[str, Any]) -> None:
        self.writer.write(msgspec.json.encode(msg) + b"\n")
        await self.writer.drain()

    async def recv(self) -> dict[str, Any]:
        line = await self.reader.readline()
        if not line:
            raise RuntimeError("the benchmark's parent closed the channel")
        return msgspec.json.decode(line)


# -- one engine's process ----------------------------------------------------------------------


async def run_level(
    side: EngineSide,
    engine: Any,
    index: int,
    streams: int,
    args: argparse.Namespace,
    make_params: Any,
    prompts: list[list[int]],
    core: Any,
    phases: PhaseReader,
) -> EngineLevel:
    """One level of this engine: fill, warm up, then measure from the parent's ``go`` to
    its ``stop`` (which it sends once every engine has run ``--steps`` steps)."""
    import psutil

    loop = Loop(engine, make_params, prompts, streams, args.tokens)
    engine.on_step(loop.on_step)
    pump = asyncio.create_task(loop.pump(), name="pump")
    me = psutil.Process()
    try:
        await loop.fill()
        await loop.wait_steps(args.warmup_steps, pump)
        await side.send({"warm": True})
        msg = await side.recv()
        if not msg.get("go"):
            raise RuntimeError(f"expected go, got {msg!r}")
        t_go = time.perf_counter()
        first = len(loop.stamps) - 1
        tokens0 = loop.delivered
        core0 = cpu_seconds(core) if core is not None else None
        me0 = cpu_seconds(me)
        phases.start()
        recv = asyncio.create_task(side.recv())
        reach = asyncio.create_task(loop.wait_until(first + 1 + args.steps, pump))
        await asyncio.wait({recv, reach}, return_when=asyncio.FIRST_COMPLETED)
        if reach.done():
            reach.result()
            await side.send({"reached": True})
            msg = await recv
        else:
            reach.cancel()
            msg = recv.result()
        if not msg.get("stop"):
            raise RuntimeError(f"expected stop, got {msg!r}")
        t_stop = time.perf_counter()
        # Tokens of the window's steps: read by the pump just after each signal.
        await asyncio.sleep(0)
        tokens = loop.delivered - tokens0
        core_s = cpu_seconds(core) - core0 if core is not None and core0 is not None else None
        me_s = cpu_seconds(me) - me0
        timed = await asyncio.to_thread(phases.stop)  # waits for fresh totals (bounded)
        stamps = [t for t in loop.stamps[max(first, 0) :] if t <= t_stop]
    finally:
        engine.on_step(None)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
    level = summarize_engine(
        index, streams, stamps, tokens, t_stop - t_go, core_s, me_s, timed
    )  # fmt: skip
    await side.send({"result": msgspec.to_builtins(level)})
    await loop.stop()
    return level


async def serve_engine(args: argparse.Namespace, side: EngineSide) -> None:
    """Build this engine (its share of the device), say ready, then run the levels the
    parent asks for until it says quit."""
    from llm_worker.engine.engine import GenerationEngine
    from llm_worker.engine.info import describe_engine
    from llm_worker.engine.plan import plan_engine
    from llm_worker.prompt import PromptBuilder
    from llm_worker.requests import RequestPlan, segment_params

    variant = args.run_variant
    most = max(max(shares(n, args.engine_count)) for n in args.streams if n >= args.engine_count)
    cfg = engine_config(args, variant, most)
    engine_plan = plan_engine(cfg, board_name(os.getpid()), args.device)
    sampling = engine_plan.sampling
    generation = None
    try:
        check_head(variant, engine_plan.head, args.lever_head)
        generation = GenerationEngine.start(cfg, args.device, engine_plan)
        info = describe_engine(generation.llm, args.device).describe()
        builder = PromptBuilder.from_pretrained(cfg.tokenizer or cfg.model)
        voice = cfg.default_voice
        prompts = builder.build_many(voice, list(TEXTS))
        vs = cfg.voice_sampling.get(voice, cfg.sampling)
        plan = RequestPlan(
            voice=voice, kind="model", sampling=vs, seed=None, total_tokens=args.tokens
        )
        counter = sampling.hooks.acquire()
        kwargs = sampling.hooks.kwargs(vs, counter)
        chars = len(TEXTS[0])
        stop_id = generation.space.end_of_speech

        def make_params(prompt_len: int, tokens: int) -> Any:
            return segment_params(cfg, plan, 0, chars, prompt_len, tokens, kwargs, stop_id)

        core = engine_core_process()
        env_dir = os.environ.get(PHASES_ENV, "").strip()
        phases = PhaseReader(Path(env_dir) if env_dir else None)
        await side.send({
            "ready": {
                "engine": f"{info}; output head: {engine_plan.head.describe()}",
                "sampling": sampling.description,
                "gpu_memory_utilization": cfg.gpu_memory_utilization,
                "max_num_seqs": cfg.max_num_seqs,
            }
        })  # fmt: skip
        while True:
            msg = await side.recv()
            if msg.get("quit"):
                await side.send({"phase_timers": phases.describe()})
                return
            n = int(msg["level"])
            level = await run_level(
                side, generation, args.engine_index, n, args, make_params, prompts, core, phases
            )  # fmt: skip
            print(
                f"  {variant} K={args.engine_count} engine {args.engine_index} N={n}: step p50 "
                f"{level.step_ms_p50:.2f} ms, p99 {level.step_ms_p99:.2f} ms, "
                f"{level.tokens_per_s:.0f} tokens/s, {level.phases_us_per_request_step}",
                flush=True,
            )
    finally:
        if generation is not None:
            generation.llm.shutdown()
        engine_plan.close()


def engine_main(args: argparse.Namespace) -> int:
    """An engine's own process: serve the parent over the control channel."""
    import uvloop

    if args.cores:
        os.sched_setaffinity(0, [int(c) for c in args.cores.split(",")])

    async def main() -> int:
        side = await EngineSide.open(args.control_fd)
        try:
            await serve_engine(args, side)
            return 0
        except Exception as e:  # the one line the table shows; the log has the rest
            import traceback

            traceback.print_exc()
            first = " ".join(str(e).split())
            with contextlib.suppress(Exception):
                await side.send({"error": f"{type(e).__name__}: {first}"[:300]})
            return 1

    return uvloop.run(main())


# -- the parent: K engine processes per variant, then the table, JSON and plot ---------------


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


def board_name(pid: int) -> str:
    return f"orpheus-bench-{pid}-prevented"


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
            frontend[str(n)] = round(_mean([p.frontend_cpu_ms_per_step for p in parts]), 3)
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


def _reference(results: list[VariantResult]) -> VariantResult | None:
    """The run the others are compared with: the first one measured."""
    return next((r for r in results if r.levels), None)


def _key(r: VariantResult) -> str:
    return f"{r.variant} K={r.engines}"


def _rows(results: list[VariantResult], streams: list[int]) -> list[Sequence[str] | None]:
    first = _reference(results)
    ref = {lv.streams: lv for lv in first.levels} if first is not None else {}
    rows: list[Sequence[str] | None] = []
    for n in streams:
        for r in results:
            for lv in r.levels:
                if lv.streams != n:
                    continue
                base = ref.get(n)
                ratio = f"{lv.step_ms_p50 / base.step_ms_p50:.2f}" if base else "-"
                gain = f"{lv.tokens_per_s / base.tokens_per_s:.2f}" if base else "-"
                cpu = lv.engine_cpu_ms_per_step
                each = "/".join(f"{e.step_ms_p50:.1f}" for e in lv.per_engine) or "-"
                rows.append((
                    r.variant, str(lv.engines), str(n), f"{lv.step_ms_p50:.2f}",
                    f"{lv.step_ms_p99:.2f}", each, ratio,
                    "-" if cpu is None else f"{cpu:.2f}",
                    "-" if lv.gpu_busy_fraction is None else f"{lv.gpu_busy_fraction:.2f}",
                    f"{lv.tokens_per_s:.0f}", gain,
                ))  # fmt: skip
        rows.append(None)
    return rows


def _phase_rows(results: list[VariantResult]) -> tuple[list[str], list[Sequence[str]]]:
    names: list[str] = []
    for r in results:
        for lv in r.levels:
            for p in lv.phases_us_per_request_step or {}:
                if p not in names:
                    names.append(p)
    names.sort(key=_phase_key)
    rows: list[Sequence[str]] = []
    for r in results:
        for lv in r.levels:
            ph = lv.phases_us_per_request_step
            if not ph:
                continue
            batch = _mean([e.streams for e in lv.per_engine]) if lv.per_engine else lv.streams
            total = sum(ph.values())
            rows.append((
                r.variant, str(lv.engines), str(lv.streams),
                *(f"{ph[p]:.1f}" if p in ph else "-" for p in names), f"{total:.1f}",
                f"{total * batch / 1e3:.2f}", f"{lv.step_ms_p50:.2f}",
            ))  # fmt: skip
    return names, rows


PHASE_HEADERS = {
    "schedule": "schedule", "update_from_output": "update", "runner_update_states": "states",
    "runner_prepare_inputs": "inputs", "runner_bookkeeping": "bookkeep", "serialize": "serialize",
}  # fmt: skip
"""Short column names of the phases (docs/benchmarks.md says what each holds)."""


def print_table(results: list[VariantResult], streams: list[int]) -> None:
    first = _reference(results)
    ref = _key(first) if first else "-"
    columns = ("variant", "K", "N", "p50 ms", "p99 ms", "p50 per engine", "p50/ref",
               "core ms/step", "GPU busy", "tokens/s", "tok/s/ref")  # fmt: skip
    title = "engine step against total streams N over K engines (closed loop, fixed length)"
    lines = [f"{_key(r)}: {r.status}: {r.reason}" for r in results if r.status != "ok"]
    rows = _rows(results, streams)
    out: list[Any] = [
        table(title, columns, rows, left=("variant",), no_wrap=True),
        f"ref: {ref}; p50/p99: the slowest engine's; core: each engine core's CPU per step, "
        "the engines' mean",
    ]
    names, phase_rows = _phase_rows(results)
    if phase_rows:
        headers = [PHASE_HEADERS.get(n, n) for n in names]
        out.append(
            table(
                "engine-core host time by phase, µs per request-step (engines' mean)",
                ("variant", "K", "N", *headers, "sum", "sum×N/K ms", "p50 ms"),
                phase_rows,
                left=("variant",),
                no_wrap=True,
            )
        )
    for r in results:
        if r.phase_timers:
            missing = r.phase_timers.rpartition("not in this vLLM: ")[2]
            out.append(f"{_key(r)} phase timers: methods not in this vLLM: {missing}")
    show(*out, *lines, min_width=150)


def plot(results: list[VariantResult], path: Path, title: str) -> None:
    plt = pyplot()

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    markers = "os^DvPX*"
    for i, r in enumerate(x for x in results if x.levels):
        color = f"C{i}"  # a colour per (variant, K), a marker per K
        marker = "-" + markers[(r.engines - 1) % len(markers)]
        xs = [lv.streams for lv in r.levels]
        label = f"{r.variant}, K={r.engines}"
        ax.plot(xs, [lv.step_ms_p50 for lv in r.levels], marker, color=color,
                label=f"{label} p50")  # fmt: skip
        ax.plot(xs, [lv.step_ms_p99 for lv in r.levels], ":", color=color, alpha=0.6)
        ax2.plot(xs, [lv.tokens_per_s for lv in r.levels], marker, color=color, label=label)
    ax.axhline(REAL_TIME_STEP_MS, color="red", linestyle=":",
               label=f"real time ({REAL_TIME_STEP_MS} ms)")  # fmt: skip
    ax.set_xlabel("concurrent streams N (all engines)")
    ax.set_ylabel("step time t(N), ms (slowest engine; p99 dotted)")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax2.set_xlabel("concurrent streams N (all engines)")
    ax2.set_ylabel("tokens/s (all engines)")
    ax2.set_title("aggregate throughput")
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)
    save(fig, path)


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


if __name__ == "__main__":
    raise SystemExit(main())
