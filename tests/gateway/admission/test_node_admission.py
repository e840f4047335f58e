"""Node-wide admission with several gateway processes (shm/admission.py, gateway/admission/queue.py).

Unit tests drive two ``Admission``s on one segment in one event loop (each with its own open
file, as two processes have); the flood test runs two real gateway processes
(``gateway.main.run``) behind one SO_REUSEPORT port with the synthetic backend behind them.
"""

from __future__ import annotations

import asyncio
import fcntl
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import numpy as np
import pytest
import zmq
from gateway_harness import NO_STORE, serve_config, wait_until
from gateway_process import start_gateway

from gateway.admission.queue import POLL_S, Admission, KeyLimits
from gateway.errors import APIError
from shm.admission import (
    ACTIVE,
    ENGINE0,
    KEY_ENTRIES,
    PID,
    QUEUED,
    SLOT_BYTES,
    AdmissionBoard,
    KeyCounts,
    key_id,
    segment_bytes,
)
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.messages import WorkerReady, orchestrator_decoder
from shm.ring import SHM_DIR
from shm.segments import create_instance, destroy_instance
from testkit.local_server import free_port
from testkit.synthetic_backend import SyntheticBackend

pytestmark = pytest.mark.timeout(120)
SMALL = ShmConfig(code_ring_bytes=64 << 10, pcm_ring_bytes=4 << 20)


@pytest.fixture
def node(layout: InstanceLayout) -> Iterator[InstanceLayout]:
    """An instance of two gateways, created as the orchestrator creates it."""
    lay = InstanceLayout(instance=layout.instance, run_dir=layout.run_dir, gateways=2)
    create_instance(lay, SMALL)
    yield lay
    destroy_instance(lay)
    assert not os.path.exists(os.path.join(SHM_DIR, lay.admission_segment))


def slots(lay: InstanceLayout) -> np.ndarray:
    """A consistent copy of the segment's slots: read under the node's lock (shared), so a
    slot handed from one process to another is never seen in both or neither."""
    with open(os.path.join(SHM_DIR, lay.admission_segment), "rb") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        raw = f.read(segment_bytes(lay.gateways))
    return np.frombuffer(raw, dtype=np.int64).reshape(-1, SLOT_BYTES // 8)[: lay.gateways].copy()


def admission(
    lay: InstanceLayout,
    index: int,
    engines: int = 1,
    key_limits: KeyLimits | None = None,
    **kw: float,
) -> Admission:
    limits = {"max_active": 2, "max_queued": 2, "queue_timeout_s": 5.0, "retry_after_s": 1}
    limits.update(kw)
    return Admission(
        int(limits["max_active"]),
        int(limits["max_queued"]),
        limits["queue_timeout_s"],
        int(limits["retry_after_s"]),
        gate=lambda: None,
        board=AdmissionBoard(lay.admission_segment, lay.gateways, index),
        engines=engines,
        key_limits=key_limits,
    )


async def test_streams_are_placed_on_the_nodes_least_loaded_engine(node: InstanceLayout) -> None:
    """Two gateways, two engines: each gateway counts the other's streams per engine, so the
    node's streams alternate between the engines whichever gateway admits them."""
    a, b = admission(node, 0, engines=2, max_active=4), admission(node, 1, engines=2, max_active=4)
    try:
        placed = [await a.acquire(), await b.acquire(), await b.acquire(), await a.acquire()]
        assert sorted(placed) == [0, 0, 1, 1]
        assert placed[:2] == [0, 1], "the second stream goes to the engine the first did not"
        assert a.full and b.full, "each engine holds its share (2 of 4)"
        published = slots(node)
        assert published[:, ENGINE0 : ENGINE0 + 2].sum(axis=0).tolist() == [2, 2]
        b.release(placed[2])
        assert await a.acquire() == placed[2], "the freed engine takes the next stream"
    finally:
        a.close()
        b.close()


async def test_limits_are_the_nodes_and_the_queue_is_served_in_node_order(
    node: InstanceLayout,
) -> None:
    a, b = admission(node, 0), admission(node, 1)
    try:
        await a.acquire()
        assert not b.full
        await b.acquire()
        assert a.full and b.full, "two slots of two are busy, whichever process counts"
        assert a.node_counts() == b.node_counts() == (2, 0)
        first = asyncio.create_task(a.acquire())  # queued first, in process 0
        await wait_until(lambda: b.node_counts()[1] == 1, what="first queued")
        second = asyncio.create_task(b.acquire())  # queued second, in process 1
        await wait_until(lambda: a.node_counts()[1] == 2, what="second queued")
        with pytest.raises(APIError) as e:  # the node's queue (2) is full: 429 from either
            await b.acquire()
        assert e.value.status == 429 and e.value.code == "server_busy"
        with pytest.raises(APIError):
            await a.acquire()

        b.release()  # process 1 frees a slot, but process 0 holds the older request
        await asyncio.wait_for(first, 1.0)
        await asyncio.sleep(4 * POLL_S)
        assert not second.done()
        assert (a.active, b.active) == (2, 0) and a.node_counts() == (2, 1)
        a.release()  # now the oldest waiter is process 1's: process 0 leaves the slot to it
        await asyncio.wait_for(second, 1.0)
        assert (a.active, b.active) == (1, 1) and b.node_counts() == (2, 0)
        published = slots(node)
        assert published[:, ACTIVE].tolist() == [1, 1]
        assert published[:, QUEUED].tolist() == [0, 0]
    finally:
        a.close()
        b.close()
    assert slots(node)[:, PID].tolist() == [0, 0], "a closed gateway gives its slot back"


async def test_a_new_request_does_not_overtake_another_processs_queue(
    node: InstanceLayout,
) -> None:
    a, b = admission(node, 0, max_active=1), admission(node, 1, max_active=1)
    try:
        await a.acquire()
        waiting = asyncio.create_task(b.acquire())
        await wait_until(lambda: a.node_counts()[1] == 1, what="queued in process 1")
        a.release()  # the slot is process 1's waiter's, not a newcomer's in process 0
        late = asyncio.create_task(a.acquire())
        await asyncio.wait_for(waiting, 1.0)
        await asyncio.sleep(4 * POLL_S)
        assert not late.done() and (a.active, b.active) == (0, 1)
        b.release()
        await asyncio.wait_for(late, 1.0)
        a.release()
        assert a.node_counts() == (0, 0)
    finally:
        a.close()
        b.close()


async def test_queue_timeout_cancel_and_drain_leave_the_node_counts_right(
    node: InstanceLayout,
) -> None:
    limits = {"max_active": 1, "max_queued": 4, "queue_timeout_s": 0.1}
    a, b = admission(node, 0, **limits), admission(node, 1, **limits)
    try:
        await a.acquire()
        with pytest.raises(APIError) as e:
            await b.acquire()
        assert e.value.code == "queue_timeout"
        t = asyncio.create_task(b.acquire())
        await wait_until(lambda: a.node_counts()[1] == 1, what="queued")
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert a.node_counts() == (1, 0)
        t = asyncio.create_task(b.acquire())
        await wait_until(lambda: a.node_counts()[1] == 1, what="queued")
        b.refuse_waiting(APIError(503, "draining", "bye"))
        with pytest.raises(APIError) as e:
            await t
        assert e.value.code == "draining" and a.node_counts() == (1, 0)
    finally:
        a.close()
        b.close()


async def test_a_keys_limit_counts_its_streams_in_every_gateway_process(
    node: InstanceLayout,
) -> None:
    """gateway.max_streams_per_key is the node's: a key with one stream in each process is at
    its limit of 2 in both; another key still gets in."""
    keys = KeyLimits(default=2)
    a = admission(node, 0, key_limits=keys, max_active=8)
    b = admission(node, 1, key_limits=keys, max_active=8)
    try:
        await a.acquire("k")
        await b.acquire("k")
        for gw in (a, b):
            with pytest.raises(APIError) as e:
                await gw.acquire("k")
            assert (e.value.status, e.value.code) == (429, "too_many_concurrent_requests")
            assert e.value.headers()["current-concurrent-requests"] == "2"
            assert e.value.headers()["maximum-concurrent-requests"] == "2"
        await a.acquire("other")
        b.release(key="k")
        await a.acquire("k")  # the key's stream in the other process ended: room again
        assert a.by_key == {"k": 2, "other": 1} and b.by_key == {}
    finally:
        a.close()
        b.close()


async def test_a_freed_slot_goes_to_the_key_holding_the_fewest_streams_on_the_node(
    node: InstanceLayout,
) -> None:
    """The flooding key's streams are in process 0, its waiter in process 1: process 1 must
    count them, or its older waiter of the flooding key would go first."""
    a, b = (
        admission(node, 0, max_active=3, max_queued=4),
        admission(node, 1, max_active=3, max_queued=4),
    )
    try:
        await a.acquire("flood")
        await a.acquire("flood")
        await b.acquire("other")
        flood = asyncio.create_task(b.acquire("flood"))
        await wait_until(lambda: b.queued == 1, what="the flood's waiter queued")
        single = asyncio.create_task(b.acquire("single"))
        await wait_until(lambda: b.queued == 2, what="the single key's waiter queued")
        b.release(key="other")
        await asyncio.wait_for(single, 1.0)
        assert not flood.done() and b.by_key == {"single": 1}
        a.release(key="flood")
        await asyncio.wait_for(flood, 1.0)
    finally:
        a.close()
        b.close()


def test_the_board_publishes_the_busiest_keys_when_a_gateway_has_more_than_fit(
    node: InstanceLayout,
) -> None:
    mine, theirs = AdmissionBoard(node.admission_segment, 2, 0), None
    try:
        theirs = AdmissionBoard(node.admission_segment, 2, 1)
        counts = {key_id(f"key-{i}"): KeyCounts(1) for i in range(KEY_ENTRIES + 5)}
        counts[key_id("busy")] = KeyCounts(3, 2, 1, 7, 4, 5)
        with theirs.locked():
            assert theirs.publish(0, 0, 0, keys=counts) == 6
        with mine.locked():
            seen = mine.others([key_id("busy"), key_id("key-0"), key_id("absent")]).keys
        assert seen[key_id("busy")] == (3, 2, 1, 7, 4, 5) and key_id("absent") not in seen
        with mine.locked():
            every = mine.others(every=True).keys
        assert len(every) == KEY_ENTRIES and every[key_id("busy")] == (3, 2, 1, 7, 4, 5)
        assert key_id("key-0") == key_id("key-0") and key_id("") > 0
    finally:
        mine.close()
        if theirs is not None:
            theirs.close()


KILLED_GATEWAY = """
import os, sys, time
from shm.admission import AdmissionBoard
board = AdmissionBoard(sys.argv[1], 2, 1)
with board.locked():
    board.publish(active=5, queued=3, oldest_wait_ns=time.monotonic_ns())
print("holding", flush=True)
time.sleep(60)
"""


def test_slots_of_a_killed_gateway_are_not_counted(node: InstanceLayout) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_GATEWAY, node.admission_segment],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        board = AdmissionBoard(node.admission_segment, 2, 0)
        try:
            with board.locked():
                assert board.others()[:2] == (5, 3)
            proc.kill()
            proc.wait()
            with board.locked():
                assert board.others()[:2] == (0, 0)
            assert slots(node)[1].tolist() == [0] * (SLOT_BYTES // 8), (
                "the dead gateway's slot is zeroed"
            )
        finally:
            board.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_board_checks_its_segment(node: InstanceLayout) -> None:
    with pytest.raises(ValueError):
        AdmissionBoard(node.admission_segment, 2, 2)
    with pytest.raises(ValueError):  # a segment sized for fewer gateways than the layout says
        AdmissionBoard(node.admission_segment, mmap.PAGESIZE // 64 + 1, 0)
    with pytest.raises(FileNotFoundError):
        AdmissionBoard(node.admission_segment + "-missing", 2, 0)


# -- two real gateway processes under a flood -------------------------------------------------
MAX_ACTIVE, MAX_QUEUED, FLOOD = 4, 2, 48


async def test_two_gateway_processes_admit_for_the_node_under_a_flood(
    node: InstanceLayout,
) -> None:
    port = free_port()
    config = serve_config(
        port=port,
        processes=2,
        max_active_streams=MAX_ACTIVE,
        max_queued_streams=MAX_QUEUED,
        queue_timeout_s=30.0,
    )
    orch = zmq.Context.instance().socket(zmq.PULL)
    orch.setsockopt(zmq.LINGER, 0)
    orch.bind(node.orch)
    backend = SyntheticBackend(node, realtime=True).start()
    procs = [start_gateway(config, node, i) for i in range(2)]
    try:
        ready: set[int] = set()
        deadline = time.monotonic() + 60
        while len(ready) < 2:
            assert time.monotonic() < deadline, "gateways not ready"
            if orch.poll(200):
                msg = orchestrator_decoder.decode(orch.recv())
                if isinstance(msg, WorkerReady):
                    ready.add(msg.pid)
            for p in procs:
                assert p.poll() is None, p.stderr.read() if p.stderr else ""
        assert slots(node)[:, PID].tolist() == [p.pid for p in procs]

        url = f"http://127.0.0.1:{port}"
        body = {"model": "tts-1", "input": "x", "voice": "alloy", "response_format": "pcm"}
        peak_node = peak_queued = 0  # most streams the node held, and queued, at once
        sampling = True

        async def sample() -> None:
            nonlocal peak_node, peak_queued
            while sampling:
                s = slots(node)
                peak_node = max(peak_node, int(s[:, ACTIVE].sum()))
                peak_queued = max(peak_queued, int(s[:, QUEUED].sum()))
                await asyncio.sleep(0.001)

        # Each connection is new (force_close), so the kernel spreads them over both processes.
        conn = aiohttp.TCPConnector(force_close=True, limit=0)
        async with aiohttp.ClientSession(connector=conn) as s:

            async def stream(frames: int = 36) -> tuple[int, str, dict[str, str]]:
                # 36 frames at real-time pace: about 3 s per stream, time enough to probe.
                tokens = 7 * frames
                async with s.post(
                    f"{url}/v1/audio/speech", json={**body, "max_tokens": tokens}, headers=NO_STORE
                ) as r:
                    await r.read()
                    return r.status, r.headers.get("Retry-After", ""), dict(r.headers)

            async def ready_probe() -> tuple[int, dict[str, object]]:
                async with s.get(f"{url}/ready") as r:
                    return r.status, await r.json()

            sampler = asyncio.create_task(sample())
            flood = [asyncio.create_task(stream()) for _ in range(FLOOD)]
            # While the node is full, /ready of every process says so (each probe is a new
            # connection: 24 of them reach both processes but with odds of 2 in 16 million).
            await wait_until(
                lambda: int(slots(node)[:, ACTIVE].sum()) == MAX_ACTIVE, 10, "node full"
            )
            probes = await asyncio.gather(*(ready_probe() for _ in range(24)))
            results = await asyncio.gather(*flood)
            sampling = False
            await sampler

            for status, state in probes:
                assert status == 503, state
                assert state["active_streams"] == MAX_ACTIVE
                assert any("slots busy" in str(r) for r in state["reasons"])  # type: ignore[attr-defined]
            statuses = [status for status, _, _ in results]
            assert set(statuses) <= {200, 429}, statuses
            assert all(ra == "1" for st, ra, _ in results if st == 429)
            # The burst arrives within a fraction of a stream's length: the node takes its 4
            # slots and 2 queue places (a few more as the first streams end), refuses the rest.
            assert statuses.count(200) >= MAX_ACTIVE + MAX_QUEUED and 429 in statuses, statuses
            assert peak_node == MAX_ACTIVE, f"the node held {peak_node} streams at once"
            assert peak_queued <= MAX_QUEUED

            # The flood is over: the node is empty and ready again, and within the limits
            # every request is served, by both processes (16 new connections: all on one
            # process with odds of 1 in 32768).
            await wait_until(lambda: not slots(node)[:, ACTIVE : QUEUED + 1].any(), 5, "empty")
            status, state = await ready_probe()
            assert status == 200 and state["active_streams"] == 0, state
            for _ in range(4):
                batch = await asyncio.gather(*(stream(3) for _ in range(MAX_ACTIVE)))
                assert [st for st, _, _ in batch] == [200] * MAX_ACTIVE
                await wait_until(lambda: not slots(node)[:, ACTIVE].any(), 5, "slots released")
            used = {sub.stream_id >> 48 for sub in backend.submitted()}
            assert used == {0, 1}, "both gateway processes served streams"
        for p in procs:
            p.send_signal(signal.SIGTERM)
        assert [p.wait(30) for p in procs] == [0, 0]
        assert slots(node)[:, PID].tolist() == [0, 0], "each gateway gave its slot back"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        backend.stop()
        orch.close(linger=0)
