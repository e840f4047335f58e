"""The orchestrator's supervision, pass by pass, through its public seams: a launcher that
starts stand-in processes (they exit, or get a signal, when the test says), a clock the test
moves, ``receive`` for the workers' messages and ``step`` for one pass of the loop.

A pass that took long is logged with its parts (a death is noticed that much later). A stop
signal ends the pass it lands in: nothing is started or announced after it. On CUDA the
engines start one after another; a ready worker that dies is restarted after its back-off; one
that fails permanently before it was ever ready stops the server with that failure's code."""

from __future__ import annotations

import logging
import signal
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import msgspec
import pytest

from common.config import ServeConfig
from common.config.llm import LLMConfig
from llm_worker.engine.env import RPC_DIR_ENV
from orchestrator.child import SPEC_ENV, ChildSpec
from orchestrator.failures import EXIT_PERMANENT
from orchestrator.supervisor import LOOP_STALL_WARN_S, Supervisor
from shm.layout import InstanceLayout
from shm.messages import WorkerFailed, WorkerReady

NO_SUCH_PID = 1 << 23
"""Above Linux's highest pid (2**22): /proc has nothing of the stand-ins' process trees."""


class Clock:
    """The supervisor's clock: it moves only when the test (or a stand-in process) says."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class StandIn:
    """A started worker that never runs: it exits when the test sets ``code``; ``on_poll``
    runs whenever the supervisor looks at it (as a slow poll or a signal would)."""

    def __init__(self, pid: int, role: str, index: int) -> None:
        self.pid = pid
        self.role = role
        self.index = index
        self.code: int | None = None
        self.signals: list[int] = []
        self.on_poll: Callable[[], None] = lambda: None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def poll(self) -> int | None:
        self.on_poll()
        return self.code

    def wait(self, timeout: float | None = None) -> int:
        if self.code is None:
            raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
        return self.code

    def kill(self) -> None:
        self.code = -signal.SIGKILL

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)


class Launcher:
    """Starts stand-ins and keeps them, in start order, with the command lines it was given."""

    def __init__(self) -> None:
        self.started: list[StandIn] = []

    def __call__(self, args: Sequence[str], env: Mapping[str, str]) -> StandIn:
        assert list(args[1:3]) == ["-m", "orchestrator.child"]
        role, index = args[3], int(args[4])
        if role == "llm":  # each llm worker is told its engine (its metrics' label)
            assert env["ORPHEUS_SERVE_ENGINE"] == str(index)
        proc = StandIn(NO_SUCH_PID + len(self.started), role, index)
        self.started.append(proc)
        return proc

    def names(self) -> list[str]:
        return [p.name for p in self.started]

    def last(self, name: str) -> StandIn:
        return [p for p in self.started if p.name == name][-1]


@pytest.fixture
def launcher() -> Launcher:
    return Launcher()


@pytest.fixture
def clock() -> Clock:
    return Clock()


def supervisor(
    layout: InstanceLayout, launcher: Launcher, clock: Clock, *, device: str = "cpu"
) -> Supervisor:
    config = ServeConfig(device=device, llm=LLMConfig(engines=layout.engines))
    return Supervisor(config, layout, launcher=launcher, clock=clock)


def ready(sup: Supervisor, proc: StandIn) -> None:
    sup.receive(WorkerReady(role=proc.role, pid=proc.pid))


def test_a_slow_loop_pass_is_logged_with_its_parts(
    layout: InstanceLayout, launcher: Launcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    sup = supervisor(layout, launcher, clock)
    sup.start_workers()
    codec = launcher.last("codec-0")

    def slow_poll(seconds: float) -> Callable[[], None]:
        def poll() -> None:
            clock.now += seconds

        return poll

    with caplog.at_level(logging.WARNING, logger="orchestrator.supervisor"):
        codec.on_poll = slow_poll(LOOP_STALL_WARN_S + 1.5)  # the children take the time
        assert sup.step() is None
        codec.on_poll = slow_poll(1.0)  # a normal pass: 1 s in all
        assert sup.step() is None
    stalls = [r.getMessage() for r in caplog.records]
    assert stalls == [
        f"supervision loop stalled {LOOP_STALL_WARN_S + 1.5:.1f}s "
        f"(children and trees {LOOP_STALL_WARN_S + 1.5:.1f}s, housekeeping 0.0s)"
    ]


def test_a_stop_signal_during_a_pass_starts_and_announces_nothing_more(
    layout: InstanceLayout, launcher: Launcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM lands while the workers become ready: no gateway starts and no "ready" line
    follows the "received SIGTERM" one (the log reads one start, then one stop)."""
    sup = supervisor(layout, launcher, clock)
    sup.start_workers()
    assert launcher.names() == ["codec-0", "llm-0"]
    for proc in launcher.started:
        ready(sup, proc)
    llm = launcher.last("llm-0")

    def sigterm_lands() -> None:  # once, while the pass looks at the children
        llm.on_poll = lambda: None
        sup.stop(signal.SIGTERM)

    llm.on_poll = sigterm_lands
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="orchestrator.supervisor"):
        assert sup.step() == 0
    assert launcher.names() == ["codec-0", "llm-0"]
    assert [r.getMessage() for r in caplog.records] == ["received SIGTERM: draining and stopping"]


def test_warm_workers_start_the_gateways_then_the_server_is_announced(
    layout: InstanceLayout, launcher: Launcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    sup = supervisor(layout, launcher, clock)
    sup.start_workers()
    assert sup.step() is None
    assert launcher.names() == ["codec-0", "llm-0"]  # no gateway before the workers are warm
    for proc in list(launcher.started):
        ready(sup, proc)
    clock.now += 2.5
    with caplog.at_level(logging.INFO, logger="orchestrator.supervisor"):
        assert sup.step() is None
        assert launcher.names() == ["codec-0", "llm-0", "gateway-0"]
        ready(sup, launcher.last("gateway-0"))
        assert sup.step() is None
        assert sup.step() is None  # announced once
    announced = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ready in")]
    assert len(announced) == 1 and announced[0].startswith("ready in 2.5s: http://")


def test_on_cuda_each_engine_starts_once_the_one_before_is_ready(
    tmp_path: Path, launcher: Launcher, clock: Clock
) -> None:
    layout = InstanceLayout(instance="orpheus-test-seq", run_dir=str(tmp_path), engines=3)
    sup = supervisor(layout, launcher, clock, device="cuda")
    sup.start_workers()
    assert launcher.names() == ["codec-0", "llm-0"]
    sup.step()
    assert launcher.names() == ["codec-0", "llm-0"]
    ready(sup, launcher.last("llm-0"))
    sup.step()
    assert launcher.names() == ["codec-0", "llm-0", "llm-1"]
    # A restart of engine 0 later does not hold engine 2 back: it was ready once.
    launcher.last("llm-0").code = -signal.SIGKILL
    ready(sup, launcher.last("llm-1"))
    sup.step()
    assert launcher.names() == ["codec-0", "llm-0", "llm-1", "llm-2"]


def test_on_cpu_the_engines_start_at_once(tmp_path: Path, launcher: Launcher, clock: Clock) -> None:
    layout = InstanceLayout(instance="orpheus-test-cpu", run_dir=str(tmp_path), engines=2)
    supervisor(layout, launcher, clock).start_workers()
    assert launcher.names() == ["codec-0", "llm-0", "llm-1"]


def test_a_ready_worker_that_dies_is_restarted_after_its_back_off(
    layout: InstanceLayout, launcher: Launcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    sup = supervisor(layout, launcher, clock)
    sup.start_workers()
    first = launcher.last("llm-0")
    ready(sup, first)
    first.code = -signal.SIGKILL
    with caplog.at_level(logging.ERROR, logger="orchestrator.supervisor"):
        assert sup.step() is None
    assert "llm exited with -9; restarting in 0.5s" in caplog.messages
    assert not sup.llms[0].ready and sup.llms[0].generation == 1
    clock.now += 0.4
    sup.step()
    assert launcher.names().count("llm-0") == 1
    clock.now += 0.2
    sup.step()
    assert launcher.names().count("llm-0") == 2
    ready(sup, first)  # a message from the dead pid is dropped
    assert not sup.llms[0].ready


def test_a_permanent_failure_before_ready_stops_the_server_with_its_line(
    layout: InstanceLayout, launcher: Launcher, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    sup = supervisor(layout, launcher, clock)
    sup.start_workers()
    llm = launcher.last("llm-0")
    sup.receive(
        WorkerFailed(role="llm", pid=llm.pid, cause="no model at /nowhere", fix="set llm.model")
    )
    llm.code = EXIT_PERMANENT
    with caplog.at_level(logging.ERROR, logger="orchestrator.supervisor"):
        assert sup.step() == EXIT_PERMANENT
    assert caplog.messages[-1] == f"giving up: {sup.exit_failure.line()}"  # type: ignore[union-attr]
    assert "no model at /nowhere" in caplog.messages[-1]


def test_the_child_spec_reaches_every_worker_whole(layout: InstanceLayout, clock: Clock) -> None:
    """What the launcher is given is the whole environment of the worker: the serialised
    configuration and layout ride in it (``orchestrator.child`` reads them back)."""
    envs: list[Mapping[str, str]] = []
    launcher = Launcher()

    def launch(args: Sequence[str], env: Mapping[str, str]) -> StandIn:
        envs.append(env)
        return launcher(args, env)

    config = ServeConfig(device="cpu")
    Supervisor(config, layout, launcher=launch, clock=clock).start_workers()
    for env in envs:
        spec = msgspec.json.decode(env[SPEC_ENV], type=ChildSpec)
        assert spec.layout == layout and spec.config == config
        assert env["PYTHONUNBUFFERED"] == "1"


def _worker_envs(layout: InstanceLayout, clock: Clock) -> dict[str, Mapping[str, str]]:
    envs: dict[str, Mapping[str, str]] = {}
    launcher = Launcher()

    def launch(args: Sequence[str], env: Mapping[str, str]) -> StandIn:
        proc = launcher(args, env)
        envs[proc.name] = env
        return proc

    Supervisor(ServeConfig(device="cpu"), layout, launcher=launch, clock=clock).start_workers()
    return envs


def test_vllms_sockets_go_in_the_instances_socket_directory(
    layout: InstanceLayout,
    clock: Clock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM never removes its ipc sockets: the llm worker is told to make them in the
    instance's socket directory, which is removed with the instance and reclaimed after a
    crash. An operator's value wins; a directory too long for a socket path leaves vLLM's
    default and says so."""
    monkeypatch.delenv(RPC_DIR_ENV, raising=False)  # the test run sets its own
    envs = _worker_envs(layout, clock)
    assert envs["llm-0"][RPC_DIR_ENV] == layout.socket_dir
    assert RPC_DIR_ENV not in envs["codec-0"]

    monkeypatch.setenv(RPC_DIR_ENV, "/run/operator")
    assert _worker_envs(layout, clock)["llm-0"][RPC_DIR_ENV] == "/run/operator"

    monkeypatch.delenv(RPC_DIR_ENV)
    deep = msgspec.structs.replace(layout, run_dir="/" + "d" * 60)  # + /orpheus-N/<uuid4>
    with caplog.at_level(logging.WARNING, logger="orchestrator.supervisor"):
        assert RPC_DIR_ENV not in _worker_envs(deep, clock)["llm-0"]
    assert [r.getMessage() for r in caplog.records] == [
        f"vLLM's ipc sockets stay in the system's temporary directory: {deep.socket_dir} is "
        "too long for a socket path under it (shm.run_dir)"
    ]
