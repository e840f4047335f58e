"""Fixtures of the end-to-end tests: the real server every module that only makes requests
of it shares (the tiny model and the engine mark are tests/conftest.py's)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from e2e_harness import Server

    from testkit.otlp_receiver import OtlpReceiver


@pytest.fixture(scope="session")
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """The OTLP/HTTP receiver ``default_server`` exports its spans to."""
    from testkit.otlp_receiver import OtlpReceiver

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
