"""The cores of each pytest-xdist worker's vLLM engines (tests/conftest.py sets them)."""

from __future__ import annotations

from common.cpu_plan import cpu_plan


def worker_engine_cores(worker: int, workers: int, cores: list[int]) -> str:
    """The cores of the vLLM engines of pytest-xdist worker ``worker`` of ``workers``, as
    ``VLLM_CPU_OMP_THREADS_BIND`` (``0,1,2``): its share of the CPU plan's engine part
    (common/cpu_plan.py), or of all the cores where that part has fewer cores than there are
    workers (on 2 cores the plan's engine part is core 0), at least one core, round the cores
    where there are fewer than workers. A server a worker starts inherits the binding and
    keeps its codec and gateways off those cores (the plan), an offline engine binds its
    threads there: two workers' engines do not share a core, which on 2 cores took 57 s a
    start-up where one took 32."""
    plan = cpu_plan("cpu", "auto", set(cores), environ={})
    pool = plan.engine if plan is not None and len(plan.engine) >= workers else tuple(cores)
    per = max(1, len(pool) // workers)
    start = worker * per % len(pool)
    return ",".join(map(str, pool[start : start + per]))
