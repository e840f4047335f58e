"""Ring invariants: order, no loss, no duplication, full = backpressure, across processes."""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shm.layout import InstanceLayout, RingEndpoints
from shm.ring import (
    RingFull,
    RingReader,
    RingWriter,
    create_ring,
    record_bytes,
    segment_path,
    unlink_ring,
)

CAPACITY = 4096


def _payload(i: int, size: int) -> bytes:
    return bytes((i * 31 + k) % 256 for k in range(size))


@pytest.fixture
def ring(layout: InstanceLayout):
    ep = layout.engine_code_ring(0)
    create_ring(ep, CAPACITY)
    reader = RingReader(ep)
    writer = RingWriter(ep)
    yield writer, reader
    writer.close()
    reader.close()
    unlink_ring(ep)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 1500)),
        st.tuples(st.just("publish"), st.just(0)),
        st.tuples(st.just("consume"), st.integers(1, 50)),
    ),
    max_size=200,
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=ops)
def test_interleaved_ops_keep_order_and_never_lose(ring, ops) -> None:
    writer, reader = ring
    # Drain whatever a previous example left (the fixture is shared across examples).
    writer.publish()
    reader.poll(1 << 20)
    reader.release()
    staged: list[tuple[int, bytes]] = []
    published: list[tuple[int, bytes]] = []
    consumed: list[tuple[int, bytes]] = []
    seq = 0
    for op, arg in ops:
        if op == "append":
            payload = _payload(seq, arg)
            if writer.try_append(1, seq % 5, seq, payload):
                staged.append((seq, payload))
                seq += 1
            else:
                # Refused only when really full: the record (plus, at worst, the unusable
                # bytes before the end of the data area, fewer than the record) did not fit.
                assert writer.free_bytes() < 2 * record_bytes(arg)
        elif op == "publish":
            writer.publish()
            published += staged
            staged.clear()
        else:
            records = reader.poll(arg)
            assert len(records) <= arg
            for r in records:
                assert r.kind == 1 and r.stream_id == r.seq % 5
                consumed.append((r.seq, bytes(r.payload)))
            reader.release()
        assert reader.used_bytes() <= CAPACITY
    writer.publish()
    published += staged
    for r in reader.poll(1 << 20):
        consumed.append((r.seq, bytes(r.payload)))
    reader.release()
    assert consumed == published


def test_full_ring_times_out_with_ringfull(ring) -> None:
    writer, _reader = ring
    big = b"x" * 1000
    n = 0
    while writer.try_append(1, 0, n, big):
        n += 1
    assert n == CAPACITY // record_bytes(len(big))
    t0 = time.monotonic()
    with pytest.raises(RingFull):
        writer.append(1, 0, n, big, timeout_s=0.1)
    assert time.monotonic() - t0 >= 0.1


def test_oversized_payload_is_refused(ring) -> None:
    writer, _ = ring
    with pytest.raises(ValueError):
        writer.try_append(1, 0, 0, b"x" * CAPACITY)


def test_numpy_payload_zero_copy_roundtrip(ring) -> None:
    writer, reader = ring
    codes = np.arange(7 * 5, dtype=np.int16).reshape(5, 7)
    assert writer.try_append(1, 42, 0, codes)
    writer.publish()
    (rec,) = reader.poll()
    np.testing.assert_array_equal(np.frombuffer(rec.payload, dtype=np.int16).reshape(5, 7), codes)
    del rec
    reader.release()


def test_consumer_sleeps_then_wakes_on_doorbell(ring) -> None:
    writer, reader = ring
    assert reader.wait(0.05) is False  # empty: times out without data
    writer.try_append(2, 1, 0, b"abc")
    writer.publish()
    assert reader.wait(1.0) is True


async def test_async_wait_and_append(ring) -> None:
    writer, reader = ring
    assert await reader.wait_async(0.02) is False
    await writer.append_async(2, 1, 0, b"hello", timeout_s=1.0)
    writer.publish()
    assert await reader.wait_async(1.0) is True
    (rec,) = reader.poll()
    assert bytes(rec.payload) == b"hello"
    del rec
    reader.release()


# -- across processes -------------------------------------------------------------------------


def _produce(ep: RingEndpoints, sizes: list[int], batch: int) -> None:
    w = RingWriter(ep)
    for i, size in enumerate(sizes):
        w.append(1, i % 3, i, _payload(i, size), timeout_s=10)
        if i % batch == 0:
            w.publish()
    w.publish()
    time.sleep(0.3)  # let the doorbell drain before the socket closes
    w.close()


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 1800), min_size=1, max_size=400),
    batch=st.integers(1, 16),
    consume_every=st.integers(1, 64),
)
def test_concurrent_producer_process(layout: InstanceLayout, sizes, batch, consume_every) -> None:
    ep = layout.pcm_ring(0)
    unlink_ring(ep)
    create_ring(ep, CAPACITY)
    reader = RingReader(ep)
    proc = mp.get_context("spawn").Process(target=_produce, args=(ep, sizes, batch))
    proc.start()
    got = 0
    try:
        deadline = time.monotonic() + 60
        while got < len(sizes) and time.monotonic() < deadline:
            if not reader.wait(1.0):
                continue
            for r in reader.poll(consume_every):
                assert r.seq == got, "records arrive in order, none lost or duplicated"
                assert bytes(r.payload) == _payload(got, sizes[got])
                got += 1
            del r
            reader.release()
    finally:
        proc.join(30)
        reader.close()
        unlink_ring(ep)
    assert got == len(sizes)
    assert proc.exitcode == 0


def test_async_append_times_out_under_uvloop(ring) -> None:
    """uvloop may fire a timer a hair before its deadline: the wait must still end."""
    import asyncio

    import uvloop

    writer, _reader = ring
    while writer.try_append(1, 0, 0, b"x" * 1000):
        pass

    async def full() -> None:
        with pytest.raises(RingFull):
            await writer.append_async(1, 0, 0, b"x" * 1000, timeout_s=0.3)

    uvloop.run(asyncio.wait_for(full(), 5))


def test_a_new_ring_has_all_its_pages_allocated(layout: InstanceLayout) -> None:
    ep = layout.engine_code_ring(0)
    create_ring(ep, 1 << 20)
    try:
        st = os.stat(segment_path(ep.segment))
        assert st.st_blocks * 512 >= st.st_size >= 1 << 20  # not sparse: flat in /dev/shm
    finally:
        unlink_ring(ep)


def test_a_dev_shm_too_small_fails_at_creation_and_leaves_nothing(
    layout: InstanceLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    ep = layout.pcm_ring(0)
    with pytest.raises(OSError, match=r"cannot allocate the 64\.0 MiB ring .*--shm-size") as e:
        create_ring(ep, 64 << 20)
    assert e.value.errno == errno.ENOSPC
    assert not os.path.exists(segment_path(ep.segment))
