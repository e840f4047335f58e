"""What every test area shares (tests/<area>/ mirrors the code: gateway, llm, codec, shm,
common, orchestrator, e2e, deploy, bench, docs; the harnesses are in tests/harness/): the
engine mark, the tiny model written once per run, a private shared-memory layout, and the lock
of the tests that take back other processes' shared memory."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.cpu_plan import VLLM_BIND_ENV
from llm_worker.engine_env import RPC_DIR_ENV, RPC_SOCKET_NAME
from shm.layout import InstanceLayout
from shm.segments import destroy_instance

ENGINE_MARK = "engine"
"""Tests that start a vLLM engine (a server, a worker, an offline engine) or write the tiny
model one loads: `make check` deselects them (``-m "not engine"``)."""


_VLLM_SOCKETS: list[str] = []
_STRAY_AT_START = pytest.StashKey[set[str]]()
VLLM_DIST_FILE = re.compile(r"vllm_dist_[0-9a-f]{32}$")
"""vLLM's torch rendezvous file (``vllm.utils.network_utils.get_file_store_init_method``)."""


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get("TESTS_NO_ENGINE"):
        # Before any engine is built here: this worker's engines get cores of their own.
        from engine_cores import worker_engine_cores

        os.environ[VLLM_BIND_ENV] = worker_engine_cores(
            int(os.environ["PYTEST_XDIST_WORKER"].removeprefix("gw")),
            int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")),
            sorted(os.sched_getaffinity(0)),
        )
    config.addinivalue_line(
        "markers",
        f"{ENGINE_MARK}: starts a vLLM engine (set on every test that uses the tiny_model "
        "fixture or is e2e); `make check` deselects these",
    )
    # vLLM makes its ipc sockets in VLLM_RPC_BASE_PATH (the system's temporary directory by
    # default) and never removes them: the engines the tests build themselves make theirs
    # in the run's own directory, removed at its end. Servers (e2e_harness) are started
    # without it, so that they put theirs where production does (the instance's sockets).
    if not os.environ.get(RPC_DIR_ENV):
        _VLLM_SOCKETS.append(tempfile.mkdtemp(prefix="orpheus-test-vllm-"))
        os.environ[RPC_DIR_ENV] = _VLLM_SOCKETS[0]


def _stray_vllm_files() -> set[str]:
    """vLLM's ipc sockets (``<uuid4>``, no suffix) and torch rendezvous files
    (``vllm_dist_<hex>``) in the system's temporary directory."""
    root = Path(tempfile.gettempdir())
    return {
        p.name
        for p in root.iterdir()
        if (RPC_SOCKET_NAME.match(p.name) and p.is_socket()) or VLLM_DIST_FILE.match(p.name)
    }


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the run's first process only
        session.config.stash[_STRAY_AT_START] = _stray_vllm_files()


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _VLLM_SOCKETS:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(RPC_DIR_ENV) == path:
            del os.environ[RPC_DIR_ENV]
    if (harness := sys.modules.get("e2e_harness")) is not None:
        # The temporary directories of the servers this process killed and never stopped.
        for path in list(harness.SERVER_TMP_DIRS):
            harness.remove_tmp_dir(path)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # An engine loads the tiny model: whatever asks for it (or is e2e) is an engine test.
    for item in items:
        if "tiny_model" in getattr(item, "fixturenames", ()) or item.get_closest_marker("e2e"):
            item.add_marker(ENGINE_MARK)
    # The shared server's users run last (in their own order), so that it is started once and
    # stopped at the session's end without idling beside the other modules' servers; the
    # slow ones first, so that pytest-xdist's workers do not end waiting on one of them.
    items.sort(
        key=lambda item: (
            "default_server" in getattr(item, "fixturenames", ()),
            item.get_closest_marker("slow") is None,
        )
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run leaves no vLLM socket in the system's temporary directory (an engine of a
    test or of a server that put its own there would, about seven a start), nor a rendezvous
    file (a SIGKILLed engine core of a server started without its own TMPDIR would); a
    pytest-xdist worker hands its engine start-ups to the run's first process."""
    harness = sys.modules.get("e2e_harness")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and harness is not None:
        workeroutput["engine_starts"] = [[t, w, n] for (t, w), n in harness.ENGINE_STARTS.items()]
    before = session.config.stash.get(_STRAY_AT_START, None)
    if before is None:
        return
    new = _stray_vllm_files() - before
    if new:
        sys.stderr.write(
            f"\nthe tests left {len(new)} vLLM socket(s) or file(s) in {tempfile.gettempdir()}: "
            f"{', '.join(sorted(new)[:5])}\n"
        )
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """pytest-xdist's hook in the run's first process: a worker's engine start-ups."""
    from e2e_harness import ENGINE_STARTS

    for test, what, n in getattr(node, "workeroutput", {}).get("engine_starts", []):
        ENGINE_STARTS[(test, what)] += n


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The engine start-ups the tests made (counted by ``e2e_harness.note_engine_start``)."""
    harness = sys.modules.get("e2e_harness")
    if harness is not None and harness.ENGINE_STARTS:
        terminalreporter.write_line(harness.engine_starts_summary())


@pytest.fixture
def shm_reclaim_lock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One at a time across pytest-xdist workers: the tests that take back dead instances'
    shared memory (a reclaim takes every dead instance's files, another test's too).
    Their modules use it (``pytestmark``). xdist's own ``xdist_group`` does not group under
    pytest 9 (measured with pytest-xdist 3.8: a module's grouped tests ran on four workers)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's folder, shared by its workers
    with open(root / "shm-reclaim.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture
def layout() -> Iterator[InstanceLayout]:
    """A private instance layout (socket dir and segment names) for one test."""
    run_dir = tempfile.mkdtemp(prefix="orpheus-test-")
    # Names carry this pid so a crashed test's leftovers are cleaned as stale later.
    lay = InstanceLayout(instance=f"orpheus-{os.getpid()}-t{os.urandom(3).hex()}", run_dir=run_dir)
    os.makedirs(lay.socket_dir)
    yield lay
    destroy_instance(lay)
    os.rmdir(run_dir) if not os.listdir(run_dir) else None


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model and its SNAC (``orpheus-serve tiny-model``), written once per test run
    and read by every test that uses it (none writes into it)."""
    from e2e_harness import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
