"""The single flight's files (``gateway.cache.flight``): the log's frames round trip, a torn
frame is delivered only once whole, a follower holds the join lock the leader asks about, a
dead leader's log is removed by the next follower and by the sweep, a live one never is."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from gateway.cache import flight
from gateway.cache.flight import FlightDamaged, FlightLog, FlightReader
from gateway.cache.node import NodeCache
from shm.records import StreamEnd, StreamError

DIGEST = "0123456789abcdef0123456789abcdef"


def test_frames_round_trip_and_a_torn_one_waits() -> None:
    end = StreamEnd("stop", 3, tokens=21)
    data = flight.pcm_frame(b"\x01\x02" * 5) + flight.pcm_frame(b"") + flight.terminal_frame(end)
    assert flight.parse(data) == ([b"\x01\x02" * 5, b""], end, len(data))
    error = StreamError("upstream_error", "it broke", 502)
    assert flight.parse(flight.terminal_frame(error))[1] == error
    for cut in range(len(data)):  # every prefix: whole frames only
        pcm, terminal, n = flight.parse(data[:cut])
        assert terminal is None and n <= cut and b"".join(pcm) == b"\x01\x02" * 5 * (n >= 15)
    with pytest.raises(FlightDamaged):
        flight.parse(b"\x07" + bytes(8))


def test_a_follower_reads_whole_frames_as_the_leader_writes_them(tmp_path: Path) -> None:
    log = FlightLog.claim(tmp_path, DIGEST)
    assert log is not None
    assert FlightLog.claim(tmp_path, DIGEST) is None  # one leader
    log.append([b"a" * 8])
    joined = FlightReader.open(tmp_path, DIGEST)
    assert joined is not None and joined.pcm == [b"a" * 8]
    reader = joined.reader
    try:
        assert not reader.leader_gone()
        assert not log.nobody_listens()  # this follower listens
        frame = flight.pcm_frame(b"b" * 6)
        with open(log.path, "ab") as f:  # half a frame, as a writer caught mid-write leaves it
            f.write(frame[:7])
        assert reader.read() == ([], None)
        with open(log.path, "ab") as f:
            f.write(frame[7:])
        assert reader.read() == ([b"b" * 6], None)
        end = StreamEnd("stop", 1)
        log.end(end)
        assert reader.read() == ([], end)
        assert reader.leader_gone()
        assert not log.path.exists() and not log.join.exists()  # the leader's end unlinks both
        assert FlightReader.open(tmp_path, DIGEST) is None
    finally:
        reader.close()
        log.close()


def test_nobody_listening_keeps_the_join_lock_so_nobody_joins(tmp_path: Path) -> None:
    log = FlightLog.claim(tmp_path, DIGEST)
    assert log is not None
    joined = FlightReader.open(tmp_path, DIGEST)
    assert joined is not None
    joined.reader.close()  # its follower left
    try:
        assert log.nobody_listens()
        assert FlightReader.open(tmp_path, DIGEST) is None  # being cancelled: synthesise
    finally:
        log.end(StreamError("cancelled", "nobody listens any more", 499))
    assert list(tmp_path.iterdir()) == []


def _dead_log(directory: Path, digest: str) -> Path:
    """A log as a leader that died leaves it: under its name, no lock, no terminal."""
    path = directory / (digest + flight.FLIGHT)
    path.write_bytes(flight.MAGIC + flight.pcm_frame(b"x" * 4))
    (directory / (digest + flight.JOIN)).touch()
    return path


def test_a_dead_leader_s_log_is_removed_by_its_next_follower(tmp_path: Path) -> None:
    dead = _dead_log(tmp_path, DIGEST)
    assert FlightReader.open(tmp_path, DIGEST) is None and not dead.exists()
    log = FlightLog.claim(tmp_path, DIGEST)  # the next request leads anew
    assert log is not None
    log.close()


def test_the_sweep_removes_dead_flights_never_a_live_one(tmp_path: Path) -> None:
    node = NodeCache(tmp_path, max_bytes=1 << 20, ttl_s=3600.0)
    tenant = node.tenant_dir("k1")
    tenant.mkdir(parents=True)
    live_digest = "f" * 32
    log = FlightLog.claim(tenant, live_digest)
    assert log is not None
    try:
        dead = _dead_log(tenant, DIGEST)
        orphan_join = tenant / ("e" * 32 + flight.JOIN)
        orphan_join.touch()
        node.sweep(now=time.time())  # too young: kept
        assert dead.exists() and orphan_join.exists()
        node.sweep(now=time.time() + 3 * 60)
        assert sorted(os.listdir(tenant)) == [
            live_digest + flight.FLIGHT,
            live_digest + flight.JOIN,
        ]
    finally:
        log.close()


def test_a_purge_mid_flight_breaks_neither_leader_nor_follower(tmp_path: Path) -> None:
    node = NodeCache(tmp_path, max_bytes=1 << 20, ttl_s=3600.0)
    tenant = node.tenant_dir("k1")
    log = FlightLog.claim(tenant, DIGEST)
    assert log is not None
    joined = FlightReader.open(tenant, DIGEST)
    assert joined is not None
    try:
        assert node.purge("k1") == 0 and not tenant.exists()
        log.append([b"c" * 4])  # both go on from the files they hold open
        end = StreamEnd("stop", 1)
        log.end(end)
        assert joined.reader.read() == ([b"c" * 4], end)
        again = FlightLog.claim(tenant, DIGEST)  # a new flight, in a new directory
        assert again is not None
        again.close()
    finally:
        joined.reader.close()
        log.close()


async def test_the_relays_write_every_chunk_in_order_however_they_are_batched(
    tmp_path: Path,
) -> None:
    """Two leaders push chunk after chunk, interleaved, while the flight thread drains the
    process's one queue in batches (one hand-off at a time): each leader's follower reads
    every chunk of its own, in order, then the end."""
    from concurrent.futures import ThreadPoolExecutor

    from gateway.cache.relay import FlightRelay, FlightWrites

    failures: list[str] = []
    io = ThreadPoolExecutor(max_workers=1)
    writes = FlightWrites(io)
    digests = [DIGEST, DIGEST[::-1]]
    try:
        relays = [
            FlightRelay(writes, tmp_path, d, lambda w, e: failures.append(f"{w}: {e}"))
            for d in digests
        ]
        io.submit(lambda: None).result()  # the logs are claimed
        joins = [FlightReader.open(tmp_path, d) for d in digests]
        assert all(j is not None for j in joins)
        chunks = [[bytes([k]) + i.to_bytes(2, "little") * (1 + i % 7) for i in range(300)]
                  for k in range(2)]  # fmt: skip
        for i in range(300):
            for k in (0, 1):
                relays[k].push(chunks[k][i])
            if i % 40 == 0:
                await asyncio.sleep(0.001)  # some drains run between pushes
        ends = [asyncio.Event(), asyncio.Event()]
        for k in (0, 1):
            relays[k].done(StreamEnd("stop", k), ends[k].set)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ends)), 5)
        assert not failures
        for k, joined in enumerate(joins):
            assert joined is not None
            pcm, terminal = list(joined.pcm), None
            while terminal is None:
                more, terminal = joined.reader.read()
                pcm += more
            joined.reader.close()
            assert pcm == chunks[k] and terminal == StreamEnd("stop", k)
    finally:
        io.shutdown(wait=True)
