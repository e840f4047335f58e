"""What every test area shares (tests/<area>/ mirrors the code: gateway, llm, codec, shm,
common, orchestrator, e2e, deploy, bench (its folders bench/'s), testkit, docs; the harnesses
are in tests/harness/): the engine mark, the tiny model written once per run, a private
shared-memory layout, the lock of the tests that take back other processes' shared memory,
and the run's own temporary directory with its end-of-run check (tests/test_run_tmpdir.py)."""

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
from llm_worker.engine.env import RPC_DIR_ENV, RPC_SOCKET_NAME
from shm.layout import InstanceLayout
from shm.segments import destroy_instance

ENGINE_MARK = "engine"
"""Tests that start a vLLM engine (a server, a worker, an offline engine) or write the tiny
model one loads: `make check` deselects them (``-m "not engine"``)."""


_VLLM_SOCKETS: list[str] = []
_RUN_TMP: list[str] = []
"""The run's temporary directory, in the process that made it."""
_STRAY_AT_START = pytest.StashKey[set[str]]()
VLLM_DIST_FILE = re.compile(r"vllm_dist_[0-9a-f]{32}$")
"""vLLM's torch rendezvous file (``vllm.utils.network_utils.get_file_store_init_method``)."""
RUN_TMP_ENV = "TESTS_RUN_TMPDIR"
"""The run's own temporary directory (:func:`_own_temporary_directory`), made by the run's
first process and inherited by everything started after it."""
SYSTEM_TMP_ENV = "TESTS_SYSTEM_TMPDIR"
"""The system's temporary directory, as it was before the run set TMPDIR."""


def _own_temporary_directory() -> None:
    """Point TMPDIR at a directory of this run's own, removed at its end (pytest_unconfigure),
    before any engine, server or pytest-xdist worker starts: they all inherit it. vLLM's engine
    core makes its torch rendezvous file there (``vllm_dist_<hex>``), which torch removes on a
    clean exit and which an engine core killed leaves: by the tests that SIGKILL a server or a
    worker, and by a stop that runs past its grace period (``bench.engine``'s 10 s, vLLM's own)
    on a loaded machine. Left in /tmp, one of those failed a CI run whose every test passed.
    A service has a /tmp of its own the same way (deploy/systemd: PrivateTmp; a container's).
    Torch's compiled-kernel cache and pytest's base temporary directories stay where they
    were, in the system's temporary directory: they outlive a run on purpose."""
    if os.environ.get(RUN_TMP_ENV):  # a pytest run started by a test uses the outer run's
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    system = tempfile.gettempdir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system)
    # Short: an instance's sockets under a directory in it (``<dir>/<instance>/<uuid4>``)
    # must fit a socket path's 107 bytes. Open to all like /tmp: nginx, started as root by
    # the front tests, runs its workers as another user under it.
    run = tempfile.mkdtemp(prefix="ot-")
    os.chmod(run, 0o1777)
    os.environ.update({RUN_TMP_ENV: run, SYSTEM_TMP_ENV: system, "TMPDIR": run})
    tempfile.tempdir = run
    _RUN_TMP.append(run)


def pytest_configure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the run's first process
        _own_temporary_directory()
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


def _vllm_files(root: str) -> tuple[set[str], set[str]]:
    """vLLM's ipc sockets (``<uuid4>``, no suffix) and torch rendezvous files
    (``vllm_dist_<hex>``) in ``root``."""
    names = list(Path(root).iterdir())
    sockets = {p.name for p in names if RPC_SOCKET_NAME.match(p.name) and p.is_socket()}
    return sockets, {p.name for p in names if VLLM_DIST_FILE.match(p.name)}


def pytest_sessionstart(session: pytest.Session) -> None:
    if _RUN_TMP:  # the run's first process only
        sockets, rendezvous = _vllm_files(os.environ[SYSTEM_TMP_ENV])
        session.config.stash[_STRAY_AT_START] = sockets | rendezvous


def pytest_unconfigure(config: pytest.Config) -> None:
    for path in _VLLM_SOCKETS:
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(RPC_DIR_ENV) == path:
            del os.environ[RPC_DIR_ENV]
    for path in _RUN_TMP:
        shutil.rmtree(path, ignore_errors=True)


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
    """No vLLM ipc socket is left in the run's temporary directory (an engine of a test or of a
    server that put its own there instead of a directory it removes would, about seven a
    start), and nothing of vLLM's escaped to the system's (something that ignored TMPDIR).
    The rendezvous files of the engine cores killed are counted and go with the run's
    directory. A pytest-xdist worker hands its engine start-ups to the run's first process."""
    harness = sys.modules.get("e2e_harness")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and harness is not None:
        workeroutput["engine_starts"] = [[t, w, n] for (t, w), n in harness.ENGINE_STARTS.items()]
    before = session.config.stash.get(_STRAY_AT_START, None)
    if before is None:
        return
    system = os.environ[SYSTEM_TMP_ENV]
    escaped = set().union(*_vllm_files(system)) - before
    sockets, rendezvous = _vllm_files(_RUN_TMP[0])
    if rendezvous:
        sys.stderr.write(
            f"\n{len(rendezvous)} rendezvous file(s) of vLLM engine cores that were killed, "
            "removed with the run's temporary directory\n"
        )
    for what, names, where in (("socket(s)", sockets, "the run's temporary directory"),
                               ("socket(s) or file(s)", escaped, system)):  # fmt: skip
        if names:
            sys.stderr.write(
                f"\nthe tests left {len(names)} vLLM {what} in {where}: "
                f"{', '.join(sorted(names)[:5])}\n"
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
    # In the run's temporary directory; a short name, so that a socket path under it
    # (``<run_dir>/<instance>/<uuid4>``, vLLM's) stays as far below 107 bytes as in /tmp.
    run_dir = tempfile.mkdtemp(prefix="i-")
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
