"""The cores of each pytest-xdist worker's vLLM engines (tests/conftest.py sets them)."""

from __future__ import annotations

from common.cpu_plan import VLLM_BIND_ENV

__all__ = ["VLLM_BIND_ENV", "worker_engine_cores"]


def worker_engine_cores(worker: int, workers: int, cores: list[int]) -> str:
    """The cores of the vLLM engines of pytest-xdist worker ``worker`` of ``workers``, as
    ``VLLM_CPU_OMP_THREADS_BIND`` (``0-5``): its share of the engine part of the CPU plan
    (common/cpu_plan.py), at least one core, round the cores where there are fewer than
    workers. A server a worker starts inherits the binding and keeps its codec and gateways
    off those cores (the plan), an offline engine binds its threads there: two workers'
    engines do not share a core, which on 2 cores took 57 s a start-up where one took 32."""
    per = max(1, len(cores) * 3 // 4 // workers)
    start = worker * per % len(cores)
    share = cores[start : start + per]
    return ",".join(map(str, share))
