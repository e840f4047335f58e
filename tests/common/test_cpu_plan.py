"""On CPU the cores are split: the llm worker and vLLM's busy processes on the first ones, the
codec and the gateways on the rest (a codec sharing a core with them waited for a whole
generation)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from engine_cores import worker_engine_cores

from common.cpu_plan import VLLM_BIND_ENV, CpuPlan, cpu_plan


@pytest.mark.parametrize(
    ("cores", "engine", "others"),
    [
        ({0, 1}, (0,), (1,)),
        ({0, 1, 2, 3}, (0, 1, 2), (3,)),
        (set(range(16)), tuple(range(12)), (12, 13, 14, 15)),
        ({2, 5, 7, 9, 11}, (2, 5, 7, 9), (11,)),  # a cpuset's cores, whatever their numbers
    ],
)
def test_vllm_gets_three_quarters_and_the_others_the_rest(
    cores: set[int], engine: tuple[int, ...], others: tuple[int, ...]
) -> None:
    assert cpu_plan("cpu", "auto", cores, environ={}) == CpuPlan(engine, others)


@pytest.mark.parametrize(
    ("device", "setting", "cores", "environ"),
    [
        ("cuda", "auto", {0, 1, 2, 3}, {}),  # the GPU runs the model: nothing to split
        ("cpu", "off", {0, 1, 2, 3}, {}),
        ("cpu", "auto", {3}, {}),  # one core: nothing to split
        ("cpu", "auto", {0, 1, 2, 3}, {VLLM_BIND_ENV: "nobind"}),
        ("cpu", "auto", {0, 1, 2, 3}, {VLLM_BIND_ENV: "0-1|2-3"}),  # vLLM's per-rank lists
        ("cpu", "auto", {0, 1, 2, 3}, {VLLM_BIND_ENV: "0-3"}),  # no core left to the others
        ("cpu", "auto", {0, 1, 2, 3}, {VLLM_BIND_ENV: "4"}),  # not a core this process has
        ("cpu", "auto", {0, 1, 2, 3}, {VLLM_BIND_ENV: "1-"}),
    ],
)
def test_no_split_where_there_is_none_to_make(
    device: str, setting: str, cores: set[int], environ: dict[str, str]
) -> None:
    assert cpu_plan(device, setting, cores, environ=environ) is None


@pytest.mark.parametrize(
    ("binding", "engine", "others"),
    [
        ("1", (1,), (0, 2, 3)),
        ("0-1", (0, 1), (2, 3)),
        (" 3,0 ", (0, 3), (1, 2)),
        ("auto", (0, 1, 2), (3,)),
    ],
)
def test_the_operators_binding_is_the_engines_part_and_the_others_get_the_rest(
    binding: str, engine: tuple[int, ...], others: tuple[int, ...]
) -> None:
    assert cpu_plan("cpu", "auto", {0, 1, 2, 3}, environ={VLLM_BIND_ENV: binding}) == CpuPlan(
        engine, others
    )


def test_the_plan_describes_itself_in_ranges() -> None:
    plan = CpuPlan(engine=(0, 1, 2, 5, 6), others=(7,))
    assert plan.describe().startswith(
        "the llm worker and vLLM on cores 0-2,5-6, the codec and the gateways on 7 "
    )


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: nothing to split")
def test_a_child_applies_its_part_before_torch_chooses_its_threads() -> None:
    """Each child pins itself, and torch, imported after, uses the cores left to it; the llm
    worker also hands vLLM the binding of its OpenMP threads."""
    code = (
        "import json, os, sys\n"
        "from common.cpu_plan import apply_cpu_plan, cpu_plan\n"
        "apply_cpu_plan(cpu_plan('cpu', 'auto', os.sched_getaffinity(0)), sys.argv[1])\n"
        "import torch\n"
        "print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads(),"
        " os.environ.get('VLLM_CPU_OMP_THREADS_BIND')]))\n"
    )
    # LD_PRELOAD: vLLM's CPU platform preloads its libgomp into this process's environment
    # once a test here has built an engine configuration, and torch then counts its threads
    # by that OpenMP; the orchestrator's children start from an environment vLLM never saw.
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (VLLM_BIND_ENV, "OMP_NUM_THREADS", "LD_PRELOAD")
    }
    cores = os.sched_getaffinity(0)
    plan = cpu_plan("cpu", "auto", cores, environ=env)
    assert plan is not None

    def child(role: str) -> list:
        r = subprocess.run(
            [sys.executable, "-c", code, role], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(r.stdout)

    assert child("codec") == [list(plan.others), len(plan.others), None]
    assert child("gateway") == [list(plan.others), len(plan.others), None]
    assert child("llm") == [list(plan.engine), len(plan.engine), ",".join(map(str, plan.engine))]


@pytest.mark.parametrize(
    ("workers", "cores", "shares"),
    [
        (2, [0, 1], ["0", "1"]),
        (2, list(range(16)), ["0,1,2,3,4,5", "6,7,8,9,10,11"]),
        (3, [0, 1], ["0", "1", "0"]),  # fewer cores than workers: round the cores
        (1, [0, 1, 2, 3], ["0,1,2"]),  # one worker: the plan's own engine part
    ],
)
def test_each_test_workers_engines_get_cores_of_their_own(
    workers: int, cores: list[int], shares: list[str]
) -> None:
    """tests/conftest.py binds each pytest-xdist worker's engines to its share; a server it
    starts keeps its codec and gateways off them (on 2 cores: one core each way)."""
    assert [worker_engine_cores(w, workers, cores) for w in range(workers)] == shares
    plans = [cpu_plan("cpu", "auto", {0, 1}, environ={VLLM_BIND_ENV: s}) for s in ("0", "1")]
    assert plans == [CpuPlan((0,), (1,)), CpuPlan((1,), (0,))]
