"""The gateway's view of the workers: ``ClusterStatus`` from the orchestrator's PUB socket."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from common.zmq_recv import incoming
from shm.messages import ClusterStatus, status_decoder

log = logging.getLogger(__name__)


def worker_lost(old: ClusterStatus | None, new: ClusterStatus) -> str | None:
    """Why the streams in flight cannot complete any more, or None.

    A bumped generation means a worker restarted (its per-stream state is gone); a worker
    that was ready and is not any more has died (the orchestrator restarts it later).
    """
    if old is None:
        return None
    if new.llm_generation != old.llm_generation or (old.llm_ready and not new.llm_ready):
        return "the llm_worker restarted"
    if new.codec_generation != old.codec_generation or (old.codec_ready and not new.codec_ready):
        return "the codec_worker restarted"
    return None


class ClusterWatcher:
    """Subscribes to ``ClusterStatus`` and reports every change to ``on_status``."""

    def __init__(self, endpoint: str, on_status: Callable[[ClusterStatus], None]) -> None:
        self._endpoint = endpoint
        self._on_status = on_status
        self.status: ClusterStatus | None = None
        self._first = asyncio.Event()

    async def wait_first(self, timeout_s: float) -> bool:
        """Wait for the first status (the orchestrator publishes it periodically)."""
        try:
            await asyncio.wait_for(self._first.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

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
                except (msgspec.DecodeError, msgspec.ValidationError) as e:
                    log.warning("undecodable ClusterStatus: %s", e)
                    continue
                if status != self.status:
                    self._on_status(status)
                    self.status = status
                self._first.set()
        except asyncio.CancelledError:
            raise
        finally:
            sock.close(linger=0)
