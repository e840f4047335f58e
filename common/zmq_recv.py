"""Receiving on an asyncio ZeroMQ socket without trusting one wakeup.

``zmq.asyncio`` learns that a socket has messages from the socket's ``ZMQ_FD``, which is
edge-triggered: it signals once when the socket goes from idle to having work, and not
again until the messages are taken. A wakeup that is lost (the signal consumed by another
call on the socket, or by an event-loop quirk: pyzmq's tracker has reports of such stalls,
e.g. #1203) leaves ``await sock.recv()`` waiting while messages queue behind it, and nothing
that arrives later wakes it. For a socket that carries the cluster's state or the requests
to a worker, that is a process that looks alive and serves nothing.

:func:`incoming` waits with a timeout and then takes every queued message without
blocking, so a lost wakeup costs at most ``recheck_s``. Per burst of messages it costs one
``poll`` and one ``ZMQ_EVENTS`` read per message more than ``await sock.recv()``: for
sockets that carry requests and state (a few messages a second), not per-token traffic.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import zmq
import zmq.asyncio

T = TypeVar("T")

RECHECK_S = 0.5
"""The longest a message can wait behind a lost wakeup."""


async def incoming(
    sock: zmq.asyncio.Socket, *, recheck_s: float = RECHECK_S
) -> AsyncIterator[bytes]:
    """The messages of ``sock`` as they arrive (single-frame), until the task is cancelled."""
    async for raw in _drain(sock, sock.recv, recheck_s):
        yield raw


async def incoming_multipart(
    sock: zmq.asyncio.Socket, *, recheck_s: float = RECHECK_S
) -> AsyncIterator[list[bytes]]:
    """The multipart messages of ``sock`` as they arrive (ROUTER: identity first)."""
    async for frames in _drain(sock, sock.recv_multipart, recheck_s):
        yield frames


async def _drain(
    sock: zmq.asyncio.Socket, recv: Callable[[int], Awaitable[T]], recheck_s: float
) -> AsyncIterator[T]:
    timeout_ms = max(1, int(recheck_s * 1000))
    while True:
        await sock.poll(timeout_ms, zmq.POLLIN)
        # Receive while the socket says a message is queued, rather than until a receive
        # fails: pyzmq hands a non-blocking receive's ``zmq.Again`` to its future, and the
        # exception's traceback holds the frame that holds the future, a reference cycle
        # (~20 objects) per burst that only the cyclic collector frees (common/heap.py).
        while sock.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                msg = await recv(zmq.NOBLOCK)
            except zmq.Again:  # queued a moment ago, gone now (not expected: one reader)
                break
            yield msg
