from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from shm.layout import InstanceLayout
from shm.segments import destroy_instance

if TYPE_CHECKING:
    from e2e_harness import Server

    from bench.doubles.otlp_receiver import OtlpReceiver

ENGINE_MARK = "engine"
"""Tests that start a vLLM engine (a server, a worker, an offline engine) or write the tiny
model one loads: `make check` deselects them (``-m "not engine"``)."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{ENGINE_MARK}: starts a vLLM engine (set on every test that uses the tiny_model "
        "fixture or is e2e); `make check` deselects these",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # An engine loads the tiny model: whatever asks for it (or is e2e) is an engine test.
    for item in items:
        if "tiny_model" in getattr(item, "fixturenames", ()) or item.get_closest_marker("e2e"):
            item.add_marker(ENGINE_MARK)
    # The shared server's users run last (in their own order), so that it is started once and
    # stopped at the session's end without idling beside the other modules' servers.
    items.sort(key=lambda item: "default_server" in getattr(item, "fixturenames", ()))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The engine start-ups the tests made (counted by ``e2e_harness.note_engine_start``)."""
    harness = sys.modules.get("e2e_harness")
    if harness is not None and harness.ENGINE_STARTS:
        terminalreporter.write_line(harness.engine_starts_summary())


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


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """The OTLP/HTTP receiver ``default_server`` exports its spans to."""
    from bench.doubles.otlp_receiver import OtlpReceiver

    with OtlpReceiver() as r:
        yield r


@pytest.fixture(scope="session")
def default_server(tiny_model: Path, otlp_receiver: OtlpReceiver) -> Iterator[Server]:
    """The real server in its default configuration, with a ZeroMQ endpoint and its traces
    exported to ``otlp_receiver``, shared by every module that only makes requests of it.

    Its users must leave it as they found it: no process killed or stopped, no setting or
    voice changed, every stream they open ended (a test that kills or reconfigures starts
    its own server). Stopped at the session's end: SIGTERM exits 0 and leaves no segment."""
    from e2e_harness import start_server, stop_server

    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.url)  # the workers inherit it
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
    mp.delenv("OTEL_SDK_DISABLED", raising=False)
    try:
        srv = start_server(tiny_model, zmq=True)
    finally:
        mp.undo()
    yield srv
    assert stop_server(srv) == 0, "SIGTERM stops the server cleanly"
    assert srv.segments_left() == [], "shared-memory segments left behind"
