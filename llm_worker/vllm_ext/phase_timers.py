"""Per-phase host time inside vLLM's engine core: a measurement tool, off unless asked for.

``bench engine`` (and anyone measuring) sets ``ORPHEUS_PROFILE_PHASES=DIR``; then every vLLM
process that runs the scheduler, the model runner or the output serialisation adds up the
wall time of a few named vLLM methods and writes its totals to ``DIR/phases-<pid>.json``
every :data:`WRITE_INTERVAL_S` (atomically: a temporary file renamed over the last one) and at
exit. A reader takes two snapshots and divides each phase's time by the request-steps counted
between them (requests scheduled in a step, summed over steps): µs per request-step, the unit
in which the engine core's per-step host work grows with the streams (t(N) ≈ a + b × N on
the H100; this says where b goes and which vLLM work a later change could cut).

**Why it wraps vLLM's methods.** vLLM has no timing hooks at this granularity (its
``record_function`` scopes exist only inside the torch profiler, whose own overhead would
swamp microsecond phases). The project's vLLM plugin (:mod:`llm_worker.vllm_ext.plugin`, which
vLLM loads in every process it starts) calls :func:`install_from_environment`; with the
variable unset it returns at once and nothing is wrapped (zero cost). With it set, the
methods below are replaced at class level, in vLLM's engine-core and worker processes only,
by a wrapper that adds ``perf_counter_ns`` differences to a per-phase total (~0.3 µs a call).
Methods are found by name; one that the installed vLLM lacks is reported (``missing`` in the
file), never guessed. The frontend process (the llm worker, the benchmark) gets only a
constructor hook on ``EngineCore``: when vLLM forks the engine core from it (its default
start method), the plugin is not loaded again in the child, so the timers are installed when
the engine core is built; with ``spawn`` the child loads the plugin and installs them itself.

Phases (each a sum of the methods that exist, by name, in vLLM 0.25.1 and 0.32):

- ``schedule``: ``Scheduler.schedule``;
- ``update_from_output``: ``Scheduler.update_from_output``;
- ``runner_update_states``: the model runner applying the scheduler's output to its
  persistent batch (V1 runner ``_update_states``; V2 ``finish_requests``, ``free_states``,
  ``add_requests``, ``update_requests``);
- ``runner_prepare_inputs``: building the step's input and attention tensors (V1
  ``_prepare_inputs``, ``_build_attention_metadata``, ``_preprocess``; V2 ``prepare_inputs``,
  ``prepare_attn``);
- ``runner_bookkeeping``: the output bookkeeping after sampling (V1 ``_bookkeeping_sync``; V2
  ``postprocess_sampled``, ``postprocess_num_computed_tokens``). On a GPU, V1's synchronous
  path waits for the sampled tokens in there;
- ``serialize``: the engine core's output serialisation (``MsgpackEncoder.encode_into`` and
  ``encode``, on the engine core's output thread).

The scheduler's phases and ``serialize`` are divided by the request-steps the scheduler
scheduled; the runner's by those the runner executed (``execute_model``'s scheduler output),
counted in the process where they run: with one device the runner runs inside the engine
core (on the CPU build too: ``llm_worker.engine.env.worker_in_engine_core``), with tensor
parallelism in the worker processes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib
import json
import multiprocessing
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "ORPHEUS_PROFILE_PHASES"
"""Names the directory the totals go to; unset or empty: no timers. (The configuration
loader ignores the ``ORPHEUS_PROFILE_`` prefix, orchestrator/settings.py.)"""
WRITE_INTERVAL_S = 0.25
VLLM_PROCESS_PREFIXES = ("EngineCore", "VllmWorker")
"""multiprocessing names of vLLM's engine-core and worker processes (0.25.1, 0.32)."""

SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
RUNNER_V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
RUNNER_V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
ENCODER = "vllm.v1.serial_utils:MsgpackEncoder"

PHASES: dict[str, tuple[str, tuple[tuple[str, str], ...]]] = {
    # phase: (the request-step counter it is divided by, ((class, method), ...))
    "schedule": ("scheduler", ((SCHEDULER, "schedule"),)),
    "update_from_output": ("scheduler", ((SCHEDULER, "update_from_output"),)),
    "runner_update_states": ("runner", (
        (RUNNER_V1, "_update_states"), (RUNNER_V2, "finish_requests"),
        (RUNNER_V2, "free_states"), (RUNNER_V2, "add_requests"), (RUNNER_V2, "update_requests"),
    )),
    "runner_prepare_inputs": ("runner", (
        (RUNNER_V1, "_prepare_inputs"), (RUNNER_V1, "_build_attention_metadata"),
        (RUNNER_V1, "_preprocess"), (RUNNER_V2, "prepare_inputs"), (RUNNER_V2, "prepare_attn"),
    )),
    "runner_bookkeeping": ("runner", (
        (RUNNER_V1, "_bookkeeping_sync"), (RUNNER_V2, "postprocess_sampled"),
        (RUNNER_V2, "postprocess_num_computed_tokens"),
    )),
    "serialize": ("scheduler", ((ENCODER, "encode_into"), (ENCODER, "encode"))),
}  # fmt: skip
COUNTERS = (
    # (counter, class, method, how the scheduler output is found)
    ("scheduler", SCHEDULER, "schedule", "result"),
    ("runner", RUNNER_V1, "execute_model", "argument"),
    ("runner", RUNNER_V2, "execute_model", "argument"),
)


class _Totals:
    """This process's sums: nanoseconds and calls per method, request-steps and steps per
    counter. Each is written by one thread (the engine core's loop, or its output thread for
    ``serialize``) and read by the writer thread."""

    def __init__(self) -> None:
        self.ns: dict[str, list[int]] = {}
        """``Class.method`` -> [nanoseconds, calls]."""
        self.phase_of: dict[str, str] = {}
        self.request_steps: dict[str, list[int]] = {"scheduler": [0, 0], "runner": [0, 0]}
        """counter -> [request-steps, steps with at least one request]."""
        self.missing: list[str] = []
        self.installed: list[str] = []

    def snapshot(self) -> dict[str, Any]:
        phases: dict[str, dict[str, Any]] = {}
        for key, (ns, calls) in list(self.ns.items()):
            phase = self.phase_of[key]
            p = phases.setdefault(
                phase, {"seconds": 0.0, "calls": 0, "per": PHASES[phase][0], "methods": {}}
            )
            p["seconds"] += ns / 1e9
            p["calls"] += calls
            p["methods"][key] = {"seconds": ns / 1e9, "calls": calls}
        return {
            "pid": os.getpid(),
            "process": multiprocessing.current_process().name,
            "time": time.time(),
            "request_steps": {k: v[0] for k, v in self.request_steps.items()},
            "steps": {k: v[1] for k, v in self.request_steps.items()},
            "phases": phases,
            "installed": self.installed,
            "missing": self.missing,
        }

    def active(self) -> bool:
        return any(calls for _, calls in self.ns.values())


_totals: _Totals | None = None
_directory: Path | None = None
_writer: threading.Thread | None = None
_lock = threading.Lock()


def _resolve(spec: str) -> type | None:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # a module this vLLM build lacks or cannot import (V2 on CPU builds)
        return None


def _timed(fn: Callable[..., Any], slot: list[int]) -> Callable[..., Any]:
    clock = time.perf_counter_ns

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            slot[0] += clock() - t0
            slot[1] += 1

    return timed


def _counted(fn: Callable[..., Any], counter: list[int], where: str) -> Callable[..., Any]:
    """Adds the requests of each step's scheduler output to ``counter`` (and the step)."""

    def add(output: Any) -> None:
        n = len(getattr(output, "num_scheduled_tokens", None) or ())
        if n:
            counter[0] += n
            counter[1] += 1

    if where == "result":

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            add(out)
            return out

        return counted

    @functools.wraps(fn)
    def counted_arg(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        add(scheduler_output)
        return fn(self, scheduler_output, *args, **kwargs)

    return counted_arg


def _replace(cls: type, name: str, kind: str, make: Callable[[Callable[..., Any]], Any]) -> bool:
    """Replace ``cls.name`` (a function defined on ``cls`` itself) by ``make(original)``,
    unless a wrapper of this ``kind`` is already there."""
    fn = cls.__dict__.get(name)
    if fn is None or not callable(fn) or getattr(fn, "__orpheus_phase__", None) == kind:
        return False
    wrapped = make(fn)
    wrapped.__orpheus_phase__ = kind
    setattr(cls, name, wrapped)
    return True


def install(directory: Path) -> _Totals:
    """Wrap every phase's methods in this process (once) and start the writer."""
    global _totals, _directory
    with _lock:
        if _totals is not None:
            return _totals
        totals = _Totals()
        # Counters first: the timers wrap the counted schedule, so that the counting is
        # outside the measured time.
        for counter, spec, method, where in COUNTERS:
            cls = _resolve(spec)
            if cls is not None:
                slot = totals.request_steps[counter]
                _replace(cls, method, "count", lambda fn, s=slot, w=where: _counted(fn, s, w))
        for phase, (_, methods) in PHASES.items():
            for spec, method in methods:
                # e.g. "worker.gpu_model_runner.GPUModelRunner._prepare_inputs" (V1) and
                # "worker.gpu.model_runner.GPUModelRunner.prepare_inputs" (V2)
                key = f"{spec.replace(':', '.').removeprefix('vllm.v1.')}.{method}"
                cls = _resolve(spec)
                slot = [0, 0]
                if cls is not None and _replace(
                    cls, method, "time", lambda fn, s=slot: _timed(fn, s)
                ):
                    totals.ns[key] = slot
                    totals.phase_of[key] = phase
                    totals.installed.append(key)
                else:
                    totals.missing.append(key)
        _totals, _directory = totals, directory
        directory.mkdir(parents=True, exist_ok=True)
        _start_writer()
        atexit.register(write)
        os.register_at_fork(after_in_child=_after_fork)
        return totals


def _after_fork() -> None:
    """A process forked from an instrumented one (vLLM's CPU worker, forked by the engine
    core) keeps the wrapped classes: it starts from zero, with its own file and writer."""
    global _writer
    if _totals is None:
        return
    for slot in _totals.ns.values():
        slot[0] = slot[1] = 0
    for counter in _totals.request_steps.values():
        counter[0] = counter[1] = 0
    _writer = None
    _start_writer()


def _start_writer() -> None:
    global _writer
    _writer = threading.Thread(target=_write_loop, name="orpheus-phase-timers", daemon=True)
    _writer.start()


def _write_loop() -> None:
    while True:
        time.sleep(WRITE_INTERVAL_S)
        write()


def write() -> Path | None:
    """This process's totals to ``DIR/phases-<pid>.json`` (nothing before its first call)."""
    totals, directory = _totals, _directory
    if totals is None or directory is None or not totals.active():
        return None
    path = directory / f"phases-{os.getpid()}.json"
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(prefix=".phases-", dir=directory)
        with os.fdopen(fd, "w") as f:
            json.dump(totals.snapshot(), f)
        os.replace(tmp, path)
        return path
    return None


def _is_vllm_process() -> bool:
    return multiprocessing.current_process().name.startswith(VLLM_PROCESS_PREFIXES)


def install_from_environment() -> None:
    """The plugin's entry: nothing unless ``ORPHEUS_PROFILE_PHASES`` names a directory."""
    target = os.environ.get(ENV, "").strip()
    if not target:
        return
    directory = Path(target)
    if _is_vllm_process():
        install(directory)
        return
    # The frontend: install in the engine core when it is built (forked engine cores do not
    # load the plugin again; an in-process engine core is built here and is timed here).
    from vllm.v1.engine.core import EngineCore

    def make(init: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(init)
        def init_and_time(self: Any, *args: Any, **kwargs: Any) -> None:
            install(directory)
            init(self, *args, **kwargs)

        return init_and_time

    _replace(EngineCore, "__init__", "install", make)


def read_snapshots(directory: Path) -> dict[int, dict[str, Any]]:
    """Every process's last written totals under ``directory``, by pid."""
    out: dict[int, dict[str, Any]] = {}
    for f in sorted(directory.glob("phases-*.json")):
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(f.read_text())
            out[int(data["pid"])] = data
    return out


def us_per_request_step(
    before: dict[int, dict[str, Any]], after: dict[int, dict[str, Any]]
) -> tuple[dict[str, float], dict[str, float]]:
    """Each phase's µs per request-step between two :func:`read_snapshots`, and the
    request-steps per step of each counter (the mean batch the phases ran on). A phase is
    divided by the request-steps its own process counted in the same interval."""
    phases: dict[str, float] = {}
    batch: dict[str, float] = {}
    for pid, end in after.items():
        start = before.get(pid, {})
        for counter, n in end.get("request_steps", {}).items():
            dn = n - start.get("request_steps", {}).get(counter, 0)
            ds = end["steps"][counter] - start.get("steps", {}).get(counter, 0)
            if dn > 0 and ds > 0:
                batch[counter] = round(dn / ds, 2)
        for phase, p in end.get("phases", {}).items():
            counter = p["per"]
            dn = end["request_steps"][counter] - start.get("request_steps", {}).get(counter, 0)
            dt = p["seconds"] - start.get("phases", {}).get(phase, {}).get("seconds", 0.0)
            if dn > 0:
                phases[phase] = round(phases.get(phase, 0.0) + dt * 1e6 / dn, 3)
    return phases, batch
