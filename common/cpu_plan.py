"""Which cores the processes run on when the model runs on CPU (``device = "cpu"``).

vLLM's CPU processes keep their cores busy while a request runs: the engine core computes
(the model worker runs in it, ``llm_worker.engine.env``; with a worker process of its own,
the worker computes and the engine core polls it). A codec worker the kernel placed on one
of those cores waited there: on the development machine (2 cores) its first window waited
for the whole generation, 10-14 s. So on CPU the orchestrator's children split the cores: the llm worker and the vLLM
processes it starts (engine core, any worker, whose OpenMP threads are bound there by
``VLLM_CPU_OMP_THREADS_BIND``) get the first ones, the codec and the gateways the rest. First
audio then came at 0.16-0.18 s, and the generation itself was no slower
(docs/performance.md). vLLM means its CPU deployments this way: it reserves cores for "the
rest". With the GPU there is nothing to split.

With several engines (``llm.engines``) the engine cores are split between them, each engine's
worker and vLLM processes on its own part; where there are fewer engine cores than engines
(the 2-core development machine), the engines share them.

An operator who binds vLLM's threads (``VLLM_CPU_OMP_THREADS_BIND``, a list of cores) chooses
the engine's part: the codec and the gateways get the cores left. Without it the codec and the
gateways would float onto the cores the operator gave vLLM and wait there as above.

Each child computes the same plan from the same inputs (the configuration, the cores the
orchestrator may use and its environment, which it inherits), so no process tells another.
"""

from __future__ import annotations

import os
from typing import NamedTuple

VLLM_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


class CpuPlan(NamedTuple):
    engine: tuple[int, ...]
    """Cores of the llm workers and their vLLM processes (the workers' OpenMP threads)."""
    others: tuple[int, ...]
    """Cores of the codec worker and the gateways."""
    engines: int = 1

    def engine_cores(self, index: int) -> tuple[int, ...]:
        """The cores of engine ``index``: its share of ``engine`` (all of them when there
        are fewer cores than engines)."""
        if len(self.engine) < self.engines:
            return self.engine
        per = len(self.engine) // self.engines
        start = index * per
        end = len(self.engine) if index == self.engines - 1 else start + per
        return self.engine[start:end]

    def describe(self) -> str:
        if self.engines > 1:
            parts = ", ".join(
                f"engine {e} on {_ranges(self.engine_cores(e))}" for e in range(self.engines)
            )
            who = f"the llm workers and vLLM ({parts})"
        else:
            who = f"the llm worker and vLLM on cores {_ranges(self.engine)}"
        return (
            f"{who}, the codec and the gateways on {_ranges(self.others)} "
            f'({VLLM_BIND_ENV}; cpu_affinity = "off" to leave it)'
        )


def cpu_plan(
    device: str,
    setting: str,
    cores: set[int] | frozenset[int],
    environ: dict[str, str] | os._Environ[str] = os.environ,
    engines: int = 1,
) -> CpuPlan | None:
    """The split, or None where there is none to make: not on CPU, ``cpu_affinity = "off"``,
    a single core, or a binding in ``VLLM_CPU_OMP_THREADS_BIND`` that is not one list of the
    cores given (vLLM's ``nobind``, per-rank lists) or that leaves none of them to the others.

    The operator's binding, where set, is the engine's part; otherwise the last quarter of the
    cores (at least one) is kept for the others."""
    if device != "cpu" or setting != "auto" or len(cores) < 2:
        return None
    ordered = sorted(cores)
    binding = environ.get(VLLM_BIND_ENV, "auto").strip()
    if binding == "auto":  # vLLM's default: its own choice, which this plan replaces
        kept = max(1, len(ordered) // 4)
        return CpuPlan(tuple(ordered[:-kept]), tuple(ordered[-kept:]), engines)
    engine = parse_cores(binding)
    if engine is None or not set(engine) <= set(cores):
        return None
    others = tuple(c for c in ordered if c not in engine)
    return CpuPlan(engine, others, engines) if others else None


def parse_cores(text: str) -> tuple[int, ...] | None:
    """``(0, 1, 2, 3, 6)`` for ``0-3,6``; None for anything else (``nobind``, ``0-1|2-3``)."""
    cores: set[int] = set()
    for part in text.split(","):
        first, sep, last = part.strip().partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            return None
        cores.update(range(int(first), int(last if sep else first) + 1))
    return tuple(sorted(cores)) or None


def apply_cpu_plan(plan: CpuPlan, role: str, index: int = 0) -> None:
    """In a child, before it imports torch (whose thread count follows the cores it may
    use): each pins itself to its part, and the llm worker of engine ``index`` hands vLLM its
    binding (vLLM's processes inherit the pinning)."""
    if role == "llm":
        cores = plan.engine_cores(index)
        os.environ[VLLM_BIND_ENV] = ",".join(map(str, cores))
        os.sched_setaffinity(0, cores)
    else:
        os.sched_setaffinity(0, plan.others)


def _ranges(cores: tuple[int, ...]) -> str:
    """``0-3,6`` for (0, 1, 2, 3, 6)."""
    parts: list[str] = []
    start = prev = cores[0]
    for c in (*cores[1:], None):
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)
