"""A worker's line to the orchestrator: ``WorkerReady`` once, then a ``Heartbeat`` a second.

Every worker process (gateway, llm_worker, codec_worker) holds one :class:`WorkerLink`:
a ZeroMQ PUSH socket connected to the orchestrator's ``orch`` PULL socket
(``InstanceLayout.orch``). Sends never block: with the orchestrator gone or slow, a
message that does not fit the 16-message queue is dropped, and the orchestrator's
heartbeat timeout is what notices a silent worker, not a stuck send.

``ready`` is also where start-up ends: it settles the heap (``common.heap``) before it
tells the orchestrator, so the collector never walks the imports and the model again.

The asynchronous workers run ``beat_forever``; the codec worker's synchronous loop calls
``beat_if_due`` from its own loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable

import zmq

from common.heap import settle as settle_heap
from shm.messages import Heartbeat, WorkerReady, control_encoder

HEARTBEAT_S = 1.0
"""Seconds between heartbeats (the orchestrator's ``heartbeat_timeout_s`` is many of these)."""
_SEND_QUEUE = 16


class WorkerLink:
    """The PUSH socket to the orchestrator, for the worker ``role`` of this process."""

    def __init__(self, endpoint: str, role: str, context: zmq.Context | None = None) -> None:
        self.role = role
        self.pid = os.getpid()
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, _SEND_QUEUE)
        self._sock.connect(endpoint)
        self._next_beat = 0.0

    def ready(self, detail: str) -> None:
        """Start-up is over: settle the heap, then tell the orchestrator (``detail`` is logged)."""
        settle_heap()
        self._send(WorkerReady(self.role, self.pid, detail))

    def beat(self, active_streams: int) -> None:
        self._send(Heartbeat(self.role, self.pid, active_streams))

    def beat_if_due(self, active_streams: int, now: float) -> bool:
        """Beat when ``HEARTBEAT_S`` has passed since the last one (``now``: time.monotonic)."""
        if now < self._next_beat:
            return False
        self._next_beat = now + HEARTBEAT_S
        self.beat(active_streams)
        return True

    def seconds_to_beat(self, now: float) -> float:
        return self._next_beat - now

    async def beat_forever(
        self, active_streams: Callable[[], int], check: Callable[[], None] | None = None
    ) -> None:
        """Beat every ``HEARTBEAT_S`` until cancelled; ``check`` runs before each beat and may
        raise to end the task (e.g. a dead engine: the worker must not look alive)."""
        while True:
            if check is not None:
                check()
            self._next_beat = time.monotonic() + HEARTBEAT_S
            self.beat(active_streams())
            await asyncio.sleep(HEARTBEAT_S)

    def close(self) -> None:
        self._sock.close(linger=0)

    def _send(self, msg: WorkerReady | Heartbeat) -> None:
        with contextlib.suppress(zmq.Again):
            self._sock.send(control_encoder.encode(msg), zmq.NOBLOCK)
