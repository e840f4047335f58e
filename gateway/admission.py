"""Admission control: at most ``max_active`` streams, a bounded FIFO queue behind them.

A request either gets a slot at once, waits in the queue (at most ``max_queued`` waiters,
each for at most ``queue_timeout_s``), or is refused with 429 and Retry-After. While the
gate is closed (draining, workers not ready) requests are refused with 503.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from gateway.errors import APIError

Gate = Callable[[], APIError | None]


class Admission:
    def __init__(
        self,
        max_active: int,
        max_queued: int,
        queue_timeout_s: float,
        retry_after_s: int,
        gate: Gate,
    ) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self._retry_after_s = retry_after_s
        self._gate = gate
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    @property
    def full(self) -> bool:
        return self.active >= self.max_active

    def _busy(self, code: str, message: str) -> APIError:
        return APIError(429, code, message, retry_after_s=self._retry_after_s)

    async def acquire(self) -> None:
        """Take a slot (waiting in the queue if needed) or raise ``APIError``."""
        refused = self._gate()
        if refused is not None:
            raise refused
        if self.active < self.max_active and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.max_queued:
            raise self._busy(
                "server_busy",
                f"all {self.max_active} streams are busy and {self.max_queued} requests wait",
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        timer = loop.call_later(self._queue_timeout_s, self._expire, fut)
        try:
            await fut  # on success the releasing stream handed its slot over (active counted)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release()  # we were handed a slot just as we were cancelled
            raise
        finally:
            timer.cancel()
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def _expire(self, fut: asyncio.Future[None]) -> None:
        if not fut.done():
            fut.set_exception(
                self._busy(
                    "queue_timeout",
                    f"no stream slot became free within {self._queue_timeout_s:g} s",
                )
            )

    def release(self) -> None:
        """Give a slot back; the oldest waiter (if any) takes it over."""
        self.active -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self.active += 1
                fut.set_result(None)
                return

    def refuse_waiting(self, error: APIError) -> None:
        """Fail every queued request with ``error`` (the gateway starts draining)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
