"""common.zmq_recv: a lost wakeup of an asyncio ZeroMQ socket costs at most ``recheck_s``.

The lost wakeup is made for real: the socket's edge-triggered ``ZMQ_FD`` is consumed
(``getsockopt(EVENTS)`` on the same socket) after a message arrived and before the event loop
saw it. A plain ``await sock.recv()`` then waits for ever (``test_..._is_what_plain_recv_misses``
shows it, so the other tests are known to exercise the failure they guard against)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest
import zmq
import zmq.asyncio

from common.zmq_recv import incoming, incoming_multipart

pytestmark = pytest.mark.timeout(30)

RECHECK_S = 0.2


def _pair(ctx: zmq.asyncio.Context) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """A PULL socket on a free loopback port and a PUSH connected to it (no linger)."""
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"tcp://127.0.0.1:{port}")
    return pull, push


async def _lost_wakeup_delivery(
    receive: Callable[[zmq.asyncio.Socket], AsyncIterator[object]], multipart: bool
) -> float | None:
    """Seconds until a message whose wakeup was lost is received (None: not within 3 s)."""
    ctx = zmq.asyncio.Context()
    pull, push = _pair(ctx)
    got: asyncio.Queue[object] = asyncio.Queue()

    async def consume() -> None:
        async for m in receive(pull):
            await got.put(m)

    task = asyncio.create_task(consume())
    try:
        await asyncio.sleep(0.2)  # the consumer is waiting
        msg = [b"id", b"payload"] if multipart else [b"payload"]
        push.send_multipart(msg)
        time.sleep(0.2)  # arrived, and the loop has not run since
        zmq.Socket.shadow(pull.underlying).getsockopt(zmq.EVENTS)  # the FD's edge is gone
        t0 = time.monotonic()
        try:
            m = await asyncio.wait_for(got.get(), 3)
        except TimeoutError:
            return None
        assert m == (msg if multipart else msg[0])
        return time.monotonic() - t0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)


async def _plain_recv(sock: zmq.asyncio.Socket) -> AsyncIterator[bytes]:
    while True:
        yield await sock.recv()


async def test_a_lost_wakeup_is_what_plain_recv_misses() -> None:
    assert await _lost_wakeup_delivery(_plain_recv, multipart=False) is None


async def test_incoming_receives_a_message_whose_wakeup_was_lost() -> None:
    waited = await _lost_wakeup_delivery(
        lambda s: incoming(s, recheck_s=RECHECK_S), multipart=False
    )
    assert waited is not None and waited < RECHECK_S + 0.5


async def test_incoming_multipart_receives_a_message_whose_wakeup_was_lost() -> None:
    waited = await _lost_wakeup_delivery(
        lambda s: incoming_multipart(s, recheck_s=RECHECK_S), multipart=True
    )
    assert waited is not None and waited < RECHECK_S + 0.5


async def test_incoming_keeps_order_under_a_burst() -> None:
    ctx = zmq.asyncio.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (pull, push):
        s.setsockopt(zmq.LINGER, 0)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        for i in range(500):
            await push.send(i.to_bytes(2, "little"))
        seen = []
        async with asyncio.timeout(10):
            async for raw in incoming(pull):
                seen.append(int.from_bytes(raw, "little"))
                if len(seen) == 500:
                    break
        assert seen == list(range(500))
    finally:
        ctx.destroy(linger=0)


async def test_a_burst_is_drained_without_leaving_cyclic_garbage() -> None:
    """pyzmq hands a non-blocking receive's ``zmq.Again`` to a future whose traceback holds
    the frame that holds the future: a cycle per burst if the loop received until a receive
    failed. ``incoming`` asks the socket first; nothing it did is left for the collector."""
    import gc

    ctx = zmq.asyncio.Context()
    pull, push = _pair(ctx)
    got: list[bytes] = []

    async def consume() -> None:
        async for m in incoming(pull, recheck_s=RECHECK_S):
            got.append(m)

    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    task = asyncio.create_task(consume())
    try:
        for burst in range(3):
            for i in range(5):
                push.send(b"%d-%d" % (burst, i))
            while len(got) < 5 * (burst + 1):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)  # the socket found empty, the consumer waits again
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if isinstance(o, zmq.ZMQError)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        ctx.destroy(linger=0)
    assert got == [b"%d-%d" % (b, i) for b in range(3) for i in range(5)]
    assert left == []
