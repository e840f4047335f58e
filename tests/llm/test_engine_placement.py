"""Placement of streams on several vLLM engines (``llm.engines``): least active streams on a
ready engine, each engine holding its share of the node's slots, nothing placed on an engine
that is not ready, and the node's capacity its ready engines' shares (gateway/admission/queue.py)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.admission.cluster import worker_lost
from gateway.admission.queue import Admission
from gateway.errors import APIError
from shm.messages import ClusterStatus, EngineStatus

pytestmark = pytest.mark.timeout(60)


def admission(
    engines: int, ready: list[bool], max_active: int = 4, max_queued: int = 4
) -> Admission:
    return Admission(
        max_active,
        max_queued,
        queue_timeout_s=5.0,
        retry_after_s=1,
        gate=lambda: None,
        engines=engines,
        ready_engines=lambda: tuple(ready),
    )


async def test_streams_alternate_and_release_frees_their_engine() -> None:
    adm = admission(2, [True, True])
    placed = [await adm.acquire() for _ in range(4)]
    assert placed == [0, 1, 0, 1]
    assert adm.by_engine == [2, 2] and adm.full
    adm.release(1)
    assert adm.by_engine == [2, 1]
    assert await adm.acquire() == 1


async def test_an_engine_that_is_not_ready_gets_nothing_and_halves_capacity() -> None:
    ready = [True, False]
    adm = admission(2, ready)
    assert adm.capacity() == 2
    assert [await adm.acquire(), await adm.acquire()] == [0, 0]
    assert adm.full, "the ready engine holds its share; the other takes none"
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0.01)
    assert not waiter.done() and adm.queued == 1
    ready[1] = True  # the engine came back: the gateway tells admission to look again
    adm.reconsider()
    assert await asyncio.wait_for(waiter, 1.0) == 1
    assert adm.capacity() == 4


async def test_no_engine_ready_queues_then_times_out() -> None:
    adm = Admission(2, 1, 0.05, 1, lambda: None, engines=2, ready_engines=lambda: (False, False))
    with pytest.raises(APIError) as e:
        await adm.acquire()
    assert e.value.code == "queue_timeout"
    assert adm.active == 0 and adm.queued == 0


@settings(max_examples=200, deadline=None)
@given(
    engines=st.integers(1, 8),
    max_active=st.integers(1, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=80),
)
def test_placement_never_exceeds_a_share_and_stays_balanced(
    engines: int, max_active: int, ops: list[tuple[bool, int]]
) -> None:
    """Invariants under any sequence of admissions and releases: no engine holds more than
    its share, the node no more than max_active, and a new stream never lands on an engine
    busier than another one with room."""
    adm = admission(engines, [True] * engines, max_active=max_active, max_queued=0)
    held: list[int] = []

    async def run() -> None:
        for acquire, pick in ops:
            if acquire:
                before = list(adm.by_engine)
                try:
                    e = await adm.acquire()
                except APIError:
                    assert adm.active >= min(max_active, adm.per_engine * engines)
                    continue
                room = [n for n in before if n < adm.per_engine]
                assert before[e] == min(room)
                held.append(e)
            elif held:
                adm.release(held.pop(pick % len(held)))
            assert all(n <= adm.per_engine for n in adm.by_engine)
            assert adm.active <= max_active

    asyncio.run(run())


def status(*engines: tuple[bool, int], codec: tuple[bool, int] = (True, 0)) -> ClusterStatus:
    return ClusterStatus(
        engines=tuple(EngineStatus(r, g) for r, g in engines),
        codec_ready=codec[0],
        draining=False,
        codec_generation=codec[1],
    )


def test_an_engine_restart_loses_only_its_streams() -> None:
    old = status((True, 0), (True, 0))
    assert not worker_lost(old, status((True, 0), (True, 0)))
    lost = worker_lost(old, status((True, 0), (False, 0)))
    assert lost.engines == frozenset({1}) and not lost.codec
    lost = worker_lost(old, status((True, 1), (True, 0)))
    assert lost.engines == frozenset({0})
    assert "engine 0" in lost.describe()
    lost = worker_lost(old, status((True, 0), (True, 0), codec=(True, 1)))
    assert lost.codec and "codec" in lost.describe()
    assert not worker_lost(None, old)
