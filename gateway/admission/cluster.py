"""The gateway's view of the workers: ``ClusterStatus`` from the orchestrator's PUB socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import NamedTuple

import zmq
import zmq.asyncio

from common.aio import wait_event
from common.zmq_recv import incoming
from shm.messages import UNDECODABLE, ClusterStatus, status_decoder

log = logging.getLogger(__name__)


class Lost(NamedTuple):
    """What a status change took away: the streams in flight there cannot complete."""

    engines: frozenset[int]
    """Engines whose streams are lost (their worker restarted or died)."""
    codec: bool
    """The codec worker restarted or died: every stream is lost."""

    def __bool__(self) -> bool:
        return self.codec or bool(self.engines)

    def describe(self) -> str:
        if self.codec:
            return "the codec_worker restarted"
        names = ", ".join(str(e) for e in sorted(self.engines))
        return f"the llm_worker of engine {names} restarted"


NOTHING_LOST = Lost(frozenset(), False)


def worker_lost(old: ClusterStatus | None, new: ClusterStatus) -> Lost:
    """Which streams in flight cannot complete any more.

    A bumped generation means a worker restarted (its per-stream state is gone); a worker
    that was ready and is not any more has died (the orchestrator restarts it later). An
    engine's loss ends only the streams placed on it; the codec's ends every stream.
    """
    if old is None:
        return NOTHING_LOST
    codec = new.codec_generation != old.codec_generation or (
        old.codec_ready and not new.codec_ready
    )
    engines = frozenset(
        e
        for e, (was, now) in enumerate(zip(old.engines, new.engines, strict=False))
        if now.generation != was.generation or (was.ready and not now.ready)
    )
    return Lost(engines, codec)


class ClusterWatcher:
    """Subscribes to ``ClusterStatus`` and reports every change to its listeners."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._listeners: list[Callable[[ClusterStatus], None]] = []
        self.status: ClusterStatus | None = None
        self._first = asyncio.Event()

    def on_change(self, listener: Callable[[ClusterStatus], None]) -> None:
        """Call ``listener`` with every new status, in the order listeners were added, while
        ``status`` is still the one before (a listener compares the two). A listener that
        raises ends ``run``: the gateway stops rather than go on without news of the workers."""
        self._listeners.append(listener)

    async def wait_first(self, timeout_s: float) -> bool:
        """Wait for the first status (the orchestrator publishes it periodically)."""
        return await wait_event(self._first, timeout_s)

    async def run(self) -> None:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self._endpoint)
        try:
            async for raw in incoming(sock):
                try:
                    status = status_decoder.decode(raw)
                except UNDECODABLE as e:
                    log.warning("undecodable ClusterStatus: %s", e)
                    continue
                if status != self.status:
                    for listener in self._listeners:
                        listener(status)
                    self.status = status
                self._first.set()
        except asyncio.CancelledError:
            raise
        finally:
            sock.close(linger=0)
