"""``orpheus-serve bench engine``: the engine alone, as a curve of step time against streams.

The engine is built exactly as the llm worker builds it: :func:`llm_worker.sampling_setup.
setup_sampling` (model runner, sampling processors), then :meth:`llm_worker.engine.
GenerationEngine.start` (the server's ``engine_args``: same model, runner, output head,
stats, prefix cache), from the server's own configuration for ``--device`` (the CPU
profile on ``cpu``). Nothing else runs: no gateway, no codec, no ring.

For each ``--streams`` level N, a closed loop keeps N fixed-length requests in the engine
(``min_tokens = max_tokens = --tokens``, built like the worker's: :func:`llm_worker.requests.
segment_params` with the voice's sampling and the sampling package's arguments; prompts from
:class:`llm_worker.prompt.PromptBuilder`). A finished request is replaced at once by the next.
Starts are staggered: the first wave's request i asks for ``tokens * (i + 1) / N`` tokens, so
requests end (and new prompts arrive) evenly from the first step on, and after
``--warmup-steps`` (default: ``--tokens``, one whole generation) the contexts are spread
evenly over 0..tokens, as in steady traffic. Then ``--steps`` steps are measured:

- step time p50 / p99 (ms): intervals between the engine's step signals (the worker's own
  step hook), i.e. the period at which each stream gets a token;
- tokens/s: tokens delivered in the measured window over its length;
- engine-core CPU ms per step: user + system CPU of vLLM's EngineCore process (psutil) over
  the window, per step (on CPU the forward pass runs there too, on all its threads);
- GPU busy fraction (CUDA only, NVML utilisation samples over the window; null on CPU).

Variants (``--variants``), each one engine start (in its own process) running every level:
``full-head`` (the whole vocabulary), ``audio-head`` (``llm.output_head = audio``),
``top-p-off`` (top_p 1.0), ``prefix-cache-off``, ``stats-off`` (``llm.engine_stats =
false``), ``kv-fp8`` (CUDA only). The last four change one thing from ``full-head``. A
variant that cannot apply here is reported as skipped, one that fails as failed (one line
each); the others go on. Prints a table, and writes ``--json`` (a ``levels`` list) and
``--png`` (t(N) per variant with the 11.5 ms real-time line).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import math
import os
import signal
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

from bench.lockstep import TEXTS
from bench.report import environment, show, table, write_json
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


class Level(msgspec.Struct, frozen=True):
    """One measured level: the JSON's ``levels`` entries, exactly these fields."""

    variant: str
    streams: int
    step_ms_p50: float
    step_ms_p99: float
    engine_cpu_ms_per_step: float | None
    gpu_busy_fraction: float | None
    tokens_per_s: float


class VariantResult(msgspec.Struct, frozen=True):
    variant: str
    status: str
    """``ok``, ``failed`` or ``skipped``."""
    reason: str | None = None
    engine: str | None = None
    sampling: str | None = None
    levels: list[Level] = []
    frontend_cpu_ms_per_step: dict[str, float] = {}
    """This process's CPU (vLLM's output processor, the closed loop) per step, by streams."""


# -- statistics (pure) -----------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    if not values:
        raise ValueError("no values")
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def intervals_ms(stamps: Sequence[float]) -> list[float]:
    """Milliseconds between consecutive step signals (``stamps`` in seconds)."""
    return [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]


def first_wave_lengths(streams: int, tokens: int) -> list[int]:
    """Token counts of the first wave's requests: ``tokens * (i + 1) / streams``, at least 1,
    so that they end one after another over one generation's length."""
    return [max(1, math.ceil(tokens * (i + 1) / streams)) for i in range(streams)]


def summarize(
    variant: str,
    streams: int,
    stamps: Sequence[float],
    tokens: int,
    engine_cpu_s: float | None,
    gpu_busy: float | None,
) -> Level:
    """A level from the step signals' times over the measured window (``len(stamps) - 1``
    steps), the tokens delivered in it and the engine core's CPU seconds over it."""
    steps = intervals_ms(stamps)
    if not steps:
        raise ValueError("a level needs at least two step signals")
    wall = stamps[-1] - stamps[0]
    return Level(
        variant=variant,
        streams=streams,
        step_ms_p50=round(quantile(steps, 0.5), 3),
        step_ms_p99=round(quantile(steps, 0.99), 3),
        engine_cpu_ms_per_step=(
            None if engine_cpu_s is None else round(engine_cpu_s * 1e3 / len(steps), 3)
        ),
        gpu_busy_fraction=None if gpu_busy is None else round(gpu_busy, 3),
        tokens_per_s=round(tokens / wall, 1) if wall > 0 else 0.0,
    )


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


def check_head(variant: str, head: Any, lever_head: str = "full") -> None:
    """Raise where the head the engine will run is not the one the variant names."""
    from llm_worker.output_head import HeadKind

    name = {"audio-head": "audio", "full-head": "full"}.get(variant, lever_head)
    want = HeadKind.AUDIO if name == "audio" else HeadKind.FULL
    if head.space.kind is not want:
        raise RuntimeError(f"{variant}: the engine would run {head.describe()}")
    plugins = {e.value for e in metadata.entry_points(group="vllm.general_plugins")}
    if want is HeadKind.AUDIO and "llm_worker.vllm_plugin:register" not in plugins:
        raise RuntimeError(
            "the audio head's vLLM plugin is not registered in this environment (entry point "
            "vllm.general_plugins, llm_worker.vllm_plugin:register); fix: reinstall the "
            "project (pip install -e .)"
        )


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
        target = len(self.stamps) + n
        while len(self.stamps) < target:
            if pump.done():
                pump.result()
                raise RuntimeError("the closed loop's pump stopped")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.engine.llm.abort([r for r in self._rids if r])
        await asyncio.sleep(0.5)


async def run_level(
    engine: Any,
    variant: str,
    streams: int,
    args: argparse.Namespace,
    make_params: Any,
    prompts: list[list[int]],
    core: Any,
    gpu: GpuBusy,
) -> tuple[Level, float]:
    import psutil

    loop = Loop(engine, make_params, prompts, streams, args.tokens)
    engine.on_step(loop.on_step)
    pump = asyncio.create_task(loop.pump(), name="pump")
    try:
        await loop.fill()
        await loop.wait_steps(args.warmup_steps, pump)
        me = psutil.Process()
        first = len(loop.stamps) - 1
        tokens0 = loop.delivered
        core0 = cpu_seconds(core) if core is not None else None
        me0 = cpu_seconds(me)
        gpu.start()
        await loop.wait_steps(args.steps, pump)
        last = first + args.steps
        stamps = loop.stamps[first : last + 1]
        # Tokens of the window's steps: read by the pump just after each signal; the last
        # step's are read within a moment of the window's end.
        await asyncio.sleep(0)
        tokens = loop.delivered - tokens0
        core_s = cpu_seconds(core) - core0 if core is not None and core0 is not None else None
        me_s = cpu_seconds(me) - me0
        busy = gpu.stop()
    finally:
        engine.on_step(None)
        pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        await loop.stop()
    level = summarize(variant, streams, stamps, tokens, core_s, busy)
    return level, me_s * 1e3 / args.steps


async def measure_variant(args: argparse.Namespace, variant: str) -> VariantResult:
    """One engine with the variant's settings, every level (runs in the variant's process)."""
    from llm_worker.engine import GenerationEngine, describe_engine
    from llm_worker.prompt import PromptBuilder
    from llm_worker.requests import RequestPlan, segment_params
    from llm_worker.sampling_setup import setup_sampling
    from orchestrator.settings import load_config

    llm: dict[str, Any] = {
        "model": args.model,
        "max_num_seqs": max(args.streams),
        "max_model_len": max(MIN_MODEL_LEN, args.tokens + PROMPT_ROOM),
        **variant_overrides(variant, args.lever_head),
    }
    cfg = load_config(None, {"device": args.device, "llm": llm}).llm
    sampling = setup_sampling(cfg, board_name(os.getpid()), args.device)
    generation = None
    try:
        check_head(variant, sampling.head, args.lever_head)
        generation = GenerationEngine.start(
            cfg, args.device, sampling.logits_processors, head=sampling.head
        )
        sampling.check_runner(generation.llm.vllm_config)
        info = describe_engine(generation.llm, args.device).describe()
        builder = PromptBuilder.from_pretrained(cfg.tokenizer or cfg.model)
        voice = cfg.default_voice
        prompts = builder.build_many(voice, list(TEXTS))
        vs = cfg.voice_sampling.get(voice, cfg.sampling)
        plan = RequestPlan(
            voice=voice, kind="model", temperature=vs.temperature, top_p=vs.top_p,
            repetition_penalty=vs.repetition_penalty, seed=None, total_tokens=args.tokens,
        )  # fmt: skip
        counter = sampling.hooks.acquire()
        kwargs = sampling.hooks.kwargs(vs.repetition_penalty, counter)
        chars = len(TEXTS[0])
        stop_id = generation.space.end_of_speech

        def make_params(prompt_len: int, tokens: int) -> Any:
            return segment_params(cfg, plan, 0, chars, prompt_len, tokens, kwargs, stop_id)

        core = engine_core_process()
        gpu = GpuBusy(args.device)
        levels: list[Level] = []
        frontend: dict[str, float] = {}
        try:
            for n in args.streams:
                level, me_ms = await run_level(
                    generation, variant, n, args, make_params, prompts, core, gpu
                )
                levels.append(level)
                frontend[str(n)] = round(me_ms, 3)
                print(
                    f"  {variant} N={n}: step p50 {level.step_ms_p50:.2f} ms, "
                    f"p99 {level.step_ms_p99:.2f} ms, {level.tokens_per_s:.0f} tokens/s",
                    flush=True,
                )
        finally:
            gpu.close()
        return VariantResult(
            variant, "ok", engine=f"{info}; output head: {sampling.head.describe()}",
            sampling=sampling.description, levels=levels,
            frontend_cpu_ms_per_step=frontend,
        )  # fmt: skip
    finally:
        if generation is not None:
            generation.llm.shutdown()
        sampling.close()


def variant_main(args: argparse.Namespace) -> int:
    """The variant's own process: measure, write the result to ``--variant-out``."""
    import uvloop

    try:
        result = uvloop.run(measure_variant(args, args.run_variant))
    except Exception as e:  # the one line the table shows; the log has the rest
        first = " ".join(str(e).split())
        result = VariantResult(
            args.run_variant, "failed", reason=f"{type(e).__name__}: {first}"[:300]
        )
        import traceback

        traceback.print_exc()
    Path(args.variant_out).write_bytes(msgspec.json.encode(result))
    return 0 if result.status == "ok" else 1


# -- the parent: one process per variant, then the table, JSON and plot -----------------------


def _child_argv(args: argparse.Namespace, variant: str, out: Path) -> list[str]:
    return [
        sys.executable, "-m", "bench.engine", "--model", args.model, "--device", args.device,
        "--streams", ",".join(map(str, args.streams)), "--steps", str(args.steps),
        "--tokens", str(args.tokens), "--warmup-steps", str(args.warmup_steps),
        "--lever-head", args.lever_head, "--run-variant", variant, "--variant-out", str(out),
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
    """Stop the variant's process group: SIGTERM, then SIGKILL after a grace period."""
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
    # The prevented-token board of a variant that was killed (it closes it otherwise).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(segment_path(board_name(proc.pid)))


def board_name(pid: int) -> str:
    return f"orpheus-bench-{pid}-prevented"


def run_variant(args: argparse.Namespace, variant: str, work: Path) -> VariantResult:
    reason = not_applicable(variant, args.device)
    if reason is not None:
        return VariantResult(variant, "skipped", reason=reason)
    out = work / f"{variant}.json"
    log = work / f"{variant}.log"
    print(f"{variant}: starting an engine (log: {log})", flush=True)
    with log.open("wb") as f:
        # Its own session: whatever it leaves (vLLM's engine processes) goes with it.
        proc = subprocess.Popen(
            _child_argv(args, variant, out), stdout=f, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            proc.wait(timeout=args.variant_timeout)
        except subprocess.TimeoutExpired:
            return VariantResult(
                variant, "failed", reason=f"no result within {args.variant_timeout} s"
            )
        finally:
            _end_session(proc)
    if out.exists():
        result = msgspec.json.decode(out.read_bytes(), type=VariantResult)
    else:
        result = VariantResult(
            variant, "failed", reason=f"exit {proc.returncode}: {_last_error_line(log)}"
        )
    if result.status != "ok":
        print(f"{variant}: FAILED: {result.reason} (log: {log})", flush=True)
    return result


def _reference(results: list[VariantResult]) -> VariantResult | None:
    """The variant the others are compared with: the first one measured."""
    return next((r for r in results if r.levels), None)


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
                cpu = lv.engine_cpu_ms_per_step
                rows.append((
                    r.variant, str(n), f"{lv.step_ms_p50:.2f}", f"{lv.step_ms_p99:.2f}", ratio,
                    "-" if cpu is None else f"{cpu:.2f}",
                    "-" if lv.gpu_busy_fraction is None else f"{lv.gpu_busy_fraction:.2f}",
                    f"{lv.tokens_per_s:.0f}",
                ))  # fmt: skip
        rows.append(None)
    return rows


def print_table(results: list[VariantResult], streams: list[int]) -> None:
    first = _reference(results)
    columns = ("variant", "N", "p50 ms", "p99 ms",
               f"p50 / {first.variant if first else '-'}",
               "core CPU ms/step", "GPU busy", "tokens/s")  # fmt: skip
    title = "engine step against streams (closed loop of fixed-length requests)"
    lines = [f"{r.variant}: {r.status}: {r.reason}" for r in results if r.status != "ok"]
    rows = _rows(results, streams)
    show(table(title, columns, rows, left=("variant",), no_wrap=True), *lines, min_width=110)


def plot(results: list[VariantResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), constrained_layout=True)
    for i, r in enumerate(x for x in results if x.levels):
        xs = [lv.streams for lv in r.levels]
        color = f"C{i}"
        ax.plot(xs, [lv.step_ms_p50 for lv in r.levels], "-o", color=color,
                label=f"{r.variant} p50")  # fmt: skip
        ax.plot(xs, [lv.step_ms_p99 for lv in r.levels], "--", color=color, alpha=0.6,
                label=f"{r.variant} p99")  # fmt: skip
    ax.axhline(REAL_TIME_STEP_MS, color="red", linestyle=":",
               label=f"real time ({REAL_TIME_STEP_MS} ms)")  # fmt: skip
    ax.set_xlabel("concurrent streams N")
    ax.set_ylabel("engine step time t(N), ms")
    ax.set_title(title)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench engine", description=__doc__.split("\n")[0]
    )
    p.add_argument("--model", help="Orpheus checkpoint (default: the tiny model, in a temp dir)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--streams", default=",".join(map(str, STREAMS)), help="levels, e.g. 16,64")
    p.add_argument("--steps", type=int, help="measured steps per level (default 300 cuda, 60 cpu)")
    p.add_argument("--tokens", type=int, help="tokens per request (default 840 cuda, 48 cpu)")
    p.add_argument("--warmup-steps", type=int, help="steps before measuring (default --tokens)")
    p.add_argument("--variants", default="full-head", help=", ".join(VARIANT_NAMES))
    p.add_argument("--lever-head", choices=["full", "audio"], default="full",
                   help="the head the lever variants (top-p-off ... kv-fp8) run")  # fmt: skip
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--png", type=Path, help="plot t(N) per variant here")
    p.add_argument("--variant-timeout", type=int, default=VARIANT_TIMEOUT_S,
                   help="seconds one variant (engine start and all levels) may take")  # fmt: skip
    p.add_argument("--run-variant", help=argparse.SUPPRESS)
    p.add_argument("--variant-out", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.streams = parse_streams(args.streams)
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
    if args.run_variant:
        return variant_main(args)

    # SIGTERM (a timeout, a supervisor) ends the run through the finally blocks that stop
    # the variant's processes.
    signal.signal(signal.SIGTERM, _terminated)
    with tempfile.TemporaryDirectory(prefix="orpheus-bench-engine-") as tmp:
        work = Path(tmp)
        if args.model is None:
            from bench.doubles.tiny_model import write_tiny_model

            write_tiny_model(work / "model")
            args.model = str(work / "model")
        t0 = time.monotonic()
        results = [run_variant(args, v, work) for v in variants]
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
                "steps": args.steps,
                "tokens": args.tokens,
                "warmup_steps": args.warmup_steps,
                "variants": variants,
                "lever_head": args.lever_head,
                "elapsed_s": round(elapsed, 1),
                "step_time": "intervals between the worker's step signals (closed loop)",
            },
            "variants": [
                {
                    "variant": r.variant,
                    "status": r.status,
                    "reason": r.reason,
                    "engine": r.engine,
                    "sampling": r.sampling,
                    "frontend_cpu_ms_per_step": r.frontend_cpu_ms_per_step,
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
