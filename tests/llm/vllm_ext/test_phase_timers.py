"""The engine core's per-phase timers (llm_worker/vllm_ext/phase_timers.py): off by default with
nothing wrapped, class-level wrapping of the methods that exist (by name) with the missing
ones reported, the totals file, and the µs per request-step arithmetic. The real run on the
tiny model is tests/bench/engine/test_bench_engine.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from llm_worker.vllm_ext.phase_timers import us_per_request_step

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), **env}, check=False,
    )  # fmt: skip


def test_off_unless_the_variable_names_a_directory() -> None:
    """Unset (or empty), the plugin imports nothing of the timers and wraps nothing."""
    p = _run(
        """
        import sys
        from vllm.v1.core.sched.scheduler import Scheduler
        before = Scheduler.__dict__["schedule"]
        from llm_worker.vllm_ext.plugin import register
        register()
        assert Scheduler.__dict__["schedule"] is before
        assert "llm_worker.vllm_ext.phase_timers" not in sys.modules
        print("off")
        """,
        {"ORPHEUS_PROFILE_PHASES": ""},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["off"]


FAKE_SCHEDULER = """
import time
from types import SimpleNamespace


class Scheduler:
    def schedule(self):
        time.sleep(0.002)
        return SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1, "c": 1})

    def idle(self):
        return SimpleNamespace(num_scheduled_tokens={})
"""


def test_install_wraps_what_exists_and_writes_totals(tmp_path: Path) -> None:
    """In an engine-core process (by its multiprocessing name), the phases' methods are
    wrapped at class level, request-steps are counted from the scheduler's output, a
    method that does not exist is reported, and the totals file is written atomically."""
    (tmp_path / "fake_sched.py").write_text(FAKE_SCHEDULER)
    out = tmp_path / "phases"
    p = _run(
        """
        import multiprocessing
        multiprocessing.current_process().name = "EngineCore"
        import llm_worker.vllm_ext.phase_timers as pt
        spec = "fake_sched:Scheduler"
        pt.PHASES.clear()
        pt.PHASES["schedule"] = ("scheduler", ((spec, "schedule"), (spec, "no_such_method")))
        pt.COUNTERS = (("scheduler", spec, "schedule", "result"),)
        from fake_sched import Scheduler
        original = Scheduler.__dict__["schedule"]
        pt.install_from_environment()
        wrapped = Scheduler.__dict__["schedule"]
        assert wrapped is not original and wrapped.__wrapped__.__wrapped__ is original
        pt.install_from_environment()  # once per process
        assert Scheduler.__dict__["schedule"] is wrapped
        for _ in range(10):
            Scheduler().schedule()
        print(pt.write())
        """,
        {"ORPHEUS_PROFILE_PHASES": str(out), "PYTHONPATH": f"{REPO}:{tmp_path}"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    path = Path(p.stdout.split()[-1])
    assert path.parent == out and path.name.startswith("phases-") and path.suffix == ".json"
    data = json.loads(path.read_text())
    assert data["process"] == "EngineCore"
    assert data["request_steps"]["scheduler"] == 30 and data["steps"]["scheduler"] == 10
    schedule = data["phases"]["schedule"]
    assert schedule["calls"] == 10 and schedule["per"] == "scheduler"
    assert 0.02 <= schedule["seconds"] < 1.0
    assert data["installed"] == ["fake_sched.Scheduler.schedule"]
    assert data["missing"] == ["fake_sched.Scheduler.no_such_method"]
    assert not list(out.glob(".phases-*"))  # the temporary file was renamed


def test_the_frontend_only_hooks_the_engine_core_constructor(tmp_path: Path) -> None:
    p = _run(
        """
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.engine.core import EngineCore
        before = Scheduler.__dict__["schedule"]
        import llm_worker.vllm_ext.phase_timers as pt
        pt.install_from_environment()
        assert Scheduler.__dict__["schedule"] is before
        assert getattr(EngineCore.__init__, "__orpheus_phase__", None) == "install"
        print("frontend")
        """,
        {"ORPHEUS_PROFILE_PHASES": str(tmp_path)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["frontend"] and not list(tmp_path.iterdir())


def _snap(pid: int, rs: dict[str, int], steps: dict[str, int], phases: dict) -> dict:
    return {
        "pid": pid, "request_steps": rs, "steps": steps,
        "phases": {k: {"seconds": s, "per": per} for k, (s, per) in phases.items()},
    }  # fmt: skip


def test_microseconds_per_request_step_between_two_snapshots() -> None:
    core0 = _snap(1, {"scheduler": 100, "runner": 0}, {"scheduler": 10, "runner": 0},
                  {"schedule": (0.001, "scheduler")})  # fmt: skip
    core1 = _snap(1, {"scheduler": 1100, "runner": 0}, {"scheduler": 60, "runner": 0},
                  {"schedule": (0.021, "scheduler"), "serialize": (0.005, "scheduler")})  # fmt: skip
    worker1 = _snap(2, {"scheduler": 0, "runner": 500}, {"scheduler": 0, "runner": 25},
                    {"runner_prepare_inputs": (0.010, "runner")})  # fmt: skip
    phases, batch = us_per_request_step({1: core0}, {1: core1, 2: worker1})
    assert phases["schedule"] == pytest.approx(20.0)  # 20 ms over 1000 request-steps
    assert phases["serialize"] == pytest.approx(5.0)
    assert phases["runner_prepare_inputs"] == pytest.approx(20.0)  # new process: from zero
    assert batch == {"scheduler": 20.0, "runner": 20.0}
    assert us_per_request_step({1: core1}, {1: core1}) == ({}, {})  # nothing scheduled
