"""The orchestrator's supervision loop reports a pass that took long (a death is noticed that
much later): the warning names which part of the pass took the time. A stop signal ends the
pass it lands in: nothing is started or announced after it."""

from __future__ import annotations

import logging
import signal

import pytest
import zmq

from common.config import ServeConfig
from orchestrator.supervisor import LOOP_STALL_WARN_S, Supervisor
from shm.layout import InstanceLayout


def test_a_slow_loop_pass_is_logged_with_its_parts(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    sup = Supervisor(ServeConfig(device="cpu"), layout)
    clock = iter([100.0 + LOOP_STALL_WARN_S + 1.5, 200.0])
    monkeypatch.setattr("orchestrator.supervisor.time.monotonic", lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger="orchestrator.supervisor"):
        sup._note_stall(start=100.0, watched=101.0)  # 1 s watching, the rest housekeeping
        sup._note_stall(start=199.0, watched=199.5)  # a normal pass: 1 s in all
    stalls = [r.getMessage() for r in caplog.records]
    assert stalls == [
        f"supervision loop stalled {LOOP_STALL_WARN_S + 1.5:.1f}s "
        f"(children and trees 1.0s, housekeeping {LOOP_STALL_WARN_S + 0.5:.1f}s)"
    ]


def test_a_stop_signal_during_a_pass_starts_and_announces_nothing_more(
    layout: InstanceLayout, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM lands while the workers become ready: no gateway starts and no "ready" line
    follows the "received SIGTERM" one (the log reads one start, then one stop)."""
    sup = Supervisor(ServeConfig(device="cpu"), layout)
    started: list[str] = []

    def watch(now: float) -> None:
        for c in sup.workers:
            c.ready = True
        sup._on_signal(signal.SIGTERM, None)

    monkeypatch.setattr(sup, "_watch", watch)
    monkeypatch.setattr(sup, "_start", lambda child: started.append(child.role))
    ctx = zmq.Context()
    try:
        with ctx.socket(zmq.PULL) as orch:
            orch.bind("inproc://orch")
            sup._orch = orch
            with caplog.at_level(logging.INFO, logger="orchestrator.supervisor"):
                assert sup._loop() == 0
    finally:
        ctx.term()
    assert started == []
    assert [r.getMessage() for r in caplog.records] == ["received SIGTERM: draining and stopping"]
