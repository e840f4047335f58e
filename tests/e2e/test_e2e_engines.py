"""Two vLLM engines in one server (``llm.engines = 2``) on CPU with the tiny model: streams
land on both engines, a WebSocket barge-in cancels on the engine its unit was placed on, and a
kill -9 of one engine's llm worker under load ends only that
engine's streams (each with a clear error, within seconds) while the other engine's streams
finish whole; the node stays ready throughout, the dead engine is restarted, and nothing is
left behind when the server stops.

The measured times are printed (``-s``): the restart of a vLLM engine on a busy 2-core CPU
is what bounds "whole again", not the server.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_harness import Server, note_engine_start, start_server, stop_server, wait_no_instance_pids
from test_e2e_faults import Outcome, _stream, log_on_failure
from test_e2e_server import _BARGE_IN_TRIES, _LLM_OUTCOMES, _elevenlabs_barge_in

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

FRAMES = 250  # 21 s of audio per stream: longer than the kill and its aftermath
WHOLE_AGAIN_S = 240.0
"""Bound on the restarted engine's return on the shared 2-core CPU (vLLM's start there)."""


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = tmp_path_factory.mktemp("engines") / "server.log"
    with open(log_path, "wb") as log:
        srv = start_server(
            tiny_model,
            "--set", "llm.engines=2",
            "--set", "drain_timeout_s=60",
            log=log,
        )  # fmt: skip
    note_engine_start("the server's second engine")
    srv.log_path = log_path
    yield srv
    assert stop_server(srv) == 0
    assert srv.segments_left() == []
    assert wait_no_instance_pids(srv.instance, 30) == []


def ready_state(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def engine_worker_pid(orchestrator_pid: int, engine: int) -> int:
    """The llm worker of ``engine`` (titled ``orpheus-serve llm-<engine>``)."""
    out = subprocess.run(
        ["pgrep", "-P", str(orchestrator_pid), "-a"], capture_output=True, text=True, check=False
    )
    pattern = re.compile(rf"(orchestrator\.child llm {engine}|orpheus-serve llm-{engine})\s*$")
    pids = [int(line.split()[0]) for line in out.stdout.splitlines() if pattern.search(line)]
    assert len(pids) == 1, f"expected one llm worker of engine {engine}: {out.stdout}"
    return pids[0]


def test_the_startup_log_states_each_engine(server: Server) -> None:
    assert server.log_path is not None
    # The gateways answer /ready a moment before the orchestrator logs its ready line (and
    # each llm worker's own start-up line also says "ready in"): wait for the orchestrator's.
    announced = re.compile(r"ready in [\d.]+s: http://\S+ \(instance \S+, 2 llm engines\)")
    deadline = time.monotonic() + 30
    while not announced.search(log := server.log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, "no ready line of the orchestrator in the log"
        time.sleep(0.2)
    assert re.search(r"llm-0 ready \(pid \d+", log) and re.search(r"llm-1 ready \(pid \d+", log)
    assert "KV cache" in log and "max streams" in log
    status, body = ready_state(server.url)
    assert status == 200 and body["engines_ready"] == body["engines"] == 2


def _engine_outcomes(server: Server, engine: int) -> dict[str, float]:
    return {o: server.metric("orpheus_llm_streams_total", engine=str(engine), outcome=o)
            for o in _LLM_OUTCOMES}  # fmt: skip


async def _barge_in_beside_a_held_stream(server: Server) -> bool:
    """Hold one long HTTP stream (placed on engine 0), then speak on the ElevenLabs socket
    (its unit placed on engine 1) and barge in. True once the barge-in's context is final."""
    held, first = Outcome(), asyncio.Event()
    holder = asyncio.create_task(_stream(server.url, 7 * FRAMES, 7, held, first))
    try:
        await asyncio.wait_for(first.wait(), 300)
        return (await _elevenlabs_barge_in(server))[1]
    finally:
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)


def test_a_barge_in_cancels_on_its_units_engine(server: Server) -> None:
    """The WebSocket unit is placed on engine 1 (engine 0 holds a stream); its barge-in
    reaches engine 1's worker as a cancel of the vLLM request. As in test_e2e_server, a try
    whose generation ended by itself before the barge-in is repeated."""
    server.wait_ready(600)
    for _ in range(_BARGE_IN_TRIES):
        before = _engine_outcomes(server, 1)
        assert asyncio.run(_barge_in_beside_a_held_stream(server))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            after = _engine_outcomes(server, 1)
            if sum(after.values()) > sum(before.values()):
                break
            time.sleep(0.5)
        assert sum(after.values()) == sum(before.values()) + 1, "the unit ran on engine 1"
        if after["cancelled"] == before["cancelled"] + 1:
            return
    raise AssertionError(f"no barge-in of {_BARGE_IN_TRIES} reached engine 1 as a cancel")


def test_kill_one_engine_ends_only_its_streams(server: Server) -> None:
    server.wait_ready(600)
    with log_on_failure(server):
        asyncio.run(_kill_one_engine(server))


async def _kill_one_engine(server: Server) -> None:
    outs = [Outcome() for _ in range(4)]
    firsts = [asyncio.Event() for _ in outs]
    tasks = [
        asyncio.create_task(_stream(server.url, 7 * FRAMES, i, o, f))
        for i, (o, f) in enumerate(zip(outs, firsts, strict=True))
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 300)
    placed = await asyncio.to_thread(_engine_gauges, server)
    assert placed == {"0": 2.0, "1": 2.0}, f"streams on each engine: {placed}"

    victim = engine_worker_pid(server.proc.pid, 1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    ready_during: list[int] = []
    while not all(t.done() for t in tasks):
        ready_during.append((await asyncio.to_thread(ready_state, server.url))[0])
        await asyncio.sleep(0.5)
    failed = [o for o in outs if o.error is not None]
    whole = [o for o in outs if o.error is None]
    print(
        f"\nengine 1's worker killed: its streams ended "
        f"{max(o.finished_at for o in failed) - killed_at:.2f}s after the kill"
        if failed
        else "\nno stream failed"
    )
    assert len(failed) == 2 and len(whole) == 2, [(o.status, o.audio, o.error) for o in outs]
    for o in failed:
        assert o.audio < FRAMES * 2048 * 2
        assert o.finished_at is not None and o.finished_at - killed_at < 5.0, (
            "an engine's streams end within 5 s of its worker's death"
        )
    for o in whole:
        assert o.status == 200 and o.audio == FRAMES * 2048 * 2, "engine 0's streams finish whole"
    assert set(ready_during) == {200}, f"/ready while engine 1 was down: {ready_during}"

    # Engine 1 comes back by itself; the node is whole again.
    note_engine_start("llm worker restart")
    deadline = killed_at + WHOLE_AGAIN_S
    while True:
        status, body = ready_state(server.url)
        if status == 200 and body["engines_ready"] == 2:
            break
        assert time.monotonic() < deadline, f"engine 1 not back within {WHOLE_AGAIN_S:.0f}s"
        await asyncio.sleep(0.5)
    print(f"whole again {time.monotonic() - killed_at:.1f}s after the kill")
    # A new stream on each engine completes.
    again = [Outcome() for _ in range(2)]
    events = [asyncio.Event() for _ in again]
    await asyncio.gather(
        *(
            _stream(server.url, 7 * 6, 90 + i, o, e)
            for i, (o, e) in enumerate(zip(again, events, strict=True))
        )
    )
    assert all(o.status == 200 and o.audio == 6 * 2048 * 2 and o.error is None for o in again)


def _engine_gauges(server: Server) -> dict[str, float]:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(
        r'^orpheus_gateway_engine_active_streams\{engine="(\d+)"\} (\S+)$', text, re.M
    ):
        out[m.group(1)] = float(m.group(2))
    return out
