"""Single flight across the node's gateway processes (``gateway.cache.flight``): two gateways
(each with its own synthetic backend) sharing one cache directory stand for two processes of
one node. Twins asked of both while one synthesises are one synthesis; a leader whose client
left goes on while another process's follower listens, and is cancelled when nobody does; a
leader process killed mid-flight fails its followers at once, and the next request leads."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway_harness import BYTES_PER_FRAME, Harness, running_gateway, wait_until

from common.config.cache import CacheConfig
from gateway.cache import flight
from shm.layout import InstanceLayout
from shm.segments import destroy_instance

pytestmark = pytest.mark.timeout(60)

SHORT = "Hello there, friend."
"""20 characters: 20 frames of the synthetic backend, 1.7 s at its real-time pace."""
REPO = Path(__file__).resolve().parents[3]


def _cache(tmp_path: Path, **kw: object) -> dict[str, object]:
    return {"cache": CacheConfig(enabled=True, dir=str(tmp_path / "cache"), **kw)}


def _body(text: str = SHORT, **kw: object) -> dict[str, object]:
    return {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm", **kw}


async def _speak(h: Harness, s: aiohttp.ClientSession, text: str = SHORT) -> tuple[str, bytes]:
    headers = {"Authorization": "Bearer k1"}
    async with s.post(h.url + "/v1/audio/speech", json=_body(text), headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers["X-Cache"], await r.read()


def _joins(h: Harness) -> float:
    return h.metric("orpheus_gateway_cache_lookups_total", {"result": "join"})


def _logs(tmp_path: Path) -> list[Path]:
    return list((tmp_path / "cache").glob("*/*" + flight.FLIGHT))


@asynccontextmanager
async def two_processes(
    layout: InstanceLayout, tmp_path: Path, **cache: object
) -> AsyncIterator[tuple[Harness, Harness]]:
    """Two gateways of one node: each its own instance layout and real-time backend, one
    cache directory."""
    other = InstanceLayout(instance=layout.instance + "b", run_dir=layout.run_dir)
    os.makedirs(other.socket_dir)
    kw: dict[str, Any] = {
        "backend": {"realtime": True},
        "serve": _cache(tmp_path, **cache),
        "api_keys": ["k1"],
        "processes": 2,  # the node's flights are logged only where other processes are
    }
    try:
        async with running_gateway(layout, **kw) as h1, running_gateway(other, **kw) as h2:
            yield h1, h2
    finally:
        destroy_instance(other)


async def test_twins_in_two_processes_synthesise_once(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with two_processes(layout, tmp_path) as (h1, h2), aiohttp.ClientSession() as s:
        first = asyncio.create_task(_speak(h1, s))
        await wait_until(lambda: bool(_logs(tmp_path)), what="the leader's log")
        twins = await asyncio.gather(*(_speak(h, s) for h in (h2, h2, h2, h1, h1)))
        state, audio = await first
        assert state == "miss" and len(audio) == len(SHORT) * BYTES_PER_FRAME
        assert twins == [("hit", audio)] * 5
        assert len(h1.backend.submitted()) == 1 and not h2.backend.submitted()
        assert (_joins(h1), _joins(h2)) == (2, 3)
        assert h2.gateway.admission.by_engine == [0] and not h2.gateway.admission.by_key
        await wait_until(lambda: not _logs(tmp_path), what="the log removed at its end")
        assert not h2.gateway.requests._tails and not h2.gateway.requests._flights


async def test_a_node_of_one_gateway_process_writes_no_log(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    """Nobody else could read it: its twins follow in memory, and its leaders write nothing
    but the entries (a log costs a write per chunk)."""
    async with (
        running_gateway(
            layout, backend={"realtime": True}, serve=_cache(tmp_path), api_keys=["k1"]
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        first = asyncio.create_task(_speak(h, s))
        await wait_until(lambda: len(h.backend.submitted()) == 1, what="the first submit")
        await asyncio.sleep(0.3)  # a log would be claimed and written by now (1.7 s to go)
        assert not _logs(tmp_path) and not h.gateway.cache.node_flights
        twin = await _speak(h, s)
        assert twin == ("hit", (await first)[1]) and _joins(h) == 1


async def test_a_leader_whose_client_left_goes_on_for_another_process_s_follower(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        two_processes(layout, tmp_path, admit_after=1) as (h1, h2),
        aiohttp.ClientSession() as s,
        aiohttp.ClientSession() as leaver,
    ):
        headers = {"Authorization": "Bearer k1"}
        resp = await leaver.post(h1.url + "/v1/audio/speech", json=_body(), headers=headers)
        await resp.content.readany()  # its first audio
        await wait_until(lambda: bool(_logs(tmp_path)), what="the leader's log")
        follower = asyncio.create_task(_speak(h2, s))
        await wait_until(lambda: _joins(h2) == 1, what="the follower joined")
        resp.close()  # the leader's client goes away mid-stream
        state, audio = await follower
        assert state == "hit" and len(audio) == len(SHORT) * BYTES_PER_FRAME  # all of it
        assert not h1.backend.cancelled_ids()  # its worker stream was not cancelled
        await wait_until(lambda: h1.gateway.admission.by_engine == [0], what="the slot freed")
        assert not h2.backend.submitted()
        # A follower that left before the leader's client: nobody listens, it is cancelled.
        other = "Another sentence, please."
        resp = await leaver.post(h1.url + "/v1/audio/speech", json=_body(other), headers=headers)
        await resp.content.readany()
        await wait_until(lambda: bool(_logs(tmp_path)), what="the second leader's log")
        async with aiohttp.ClientSession() as brief:
            r = await brief.post(h2.url + "/v1/audio/speech", json=_body(other), headers=headers)
            await r.content.readany()
            assert r.headers["X-Cache"] == "hit"
            r.close()
        await wait_until(lambda: not h2.gateway.requests._tails, what="the follower left")
        resp.close()
        await wait_until(lambda: len(h1.backend.cancelled_ids()) == 1, what="the leader cancelled")
        await wait_until(lambda: h1.gateway.admission.by_engine == [0], what="its slot freed")
        await wait_until(lambda: not _logs(tmp_path), what="its log removed")
        assert not h2.backend.submitted()


LEADER = """
import sys, time
from pathlib import Path
from gateway.cache.flight import FlightLog
log = FlightLog.claim(Path(sys.argv[1]), sys.argv[2])
assert log is not None
for _ in range(3):
    log.append([bytes(4096)])
print("leading", flush=True)
time.sleep(60)
"""


async def test_a_leader_process_killed_mid_flight_fails_its_followers_and_is_replaced(
    layout: InstanceLayout, tmp_path: Path
) -> None:
    async with (
        running_gateway(
            layout, serve=_cache(tmp_path, admit_after=1), api_keys=["k1"], processes=2
        ) as h,
        aiohttp.ClientSession() as s,
    ):
        assert (await _speak(h, s))[0] == "miss"  # stored: its entry names the unit's file
        await wait_until(lambda: bool(list((tmp_path / "cache").glob("*/*.pcm"))), what="stored")
        (entry,) = (tmp_path / "cache").glob("*/*.pcm")
        entry.unlink()
        proc = subprocess.Popen(
            [sys.executable, "-c", LEADER, str(entry.parent), entry.stem],
            stdout=subprocess.PIPE,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        try:
            assert proc.stdout is not None
            line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
            assert line == b"leading\n"
            headers = {"Authorization": "Bearer k1"}
            async with s.post(
                h.url + "/v1/audio/speech", json=_body(stream_format="sse"), headers=headers
            ) as r:
                assert r.status == 200 and r.headers["X-Cache"] == "hit"
                await r.content.readany()  # the leader's audio so far
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                events = await asyncio.wait_for(r.text(), timeout=10)  # no hang
            assert "flight_leader_died" in events and "died; ask again" in events
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            if proc.stdout is not None:
                proc.stdout.close()
        assert _logs(tmp_path)  # the dead leader's log, until the next request
        submits = len(h.backend.submitted())
        state, audio = await _speak(h, s)
        assert state == "miss" and len(audio) == len(SHORT) * BYTES_PER_FRAME  # led anew
        assert len(h.backend.submitted()) == submits + 1
        assert not _logs(tmp_path) and not h.gateway.requests._tails
