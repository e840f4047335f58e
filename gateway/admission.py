"""Admission control: at most ``max_active`` streams, a bounded FIFO queue behind them, and
each admitted stream placed on one of the node's vLLM engines.

A request either gets a slot at once, waits in the queue (at most ``max_queued`` waiters,
each for at most ``queue_timeout_s``), or is refused with 429 and Retry-After. While the
gate is closed (draining, no engine or no codec ready) requests are refused with 503.

Placement (``llm.engines`` > 1): a slot is a slot on one engine. Each engine takes at most
``ceil(max_active / engines)`` streams, and a stream goes to the ready engine with the
fewest active streams on the node (ties: the lower index); every later message of the
stream goes to the same engine (``gateway.requests``). An engine that is not ready gets
nothing, so the node's capacity is its ready engines' share: it is full when all of them
are, and takes streams while any one is ready.

The limits are the node's. With one gateway process they are counted here; with several
(``gateway.processes > 1``) every process counts against the node's shared
``shm.admission.AdmissionBoard``: a request is admitted at once only when the node has a free
slot and nobody on the node waits; queued requests are served in node-wide arrival order. A
slot freed in one process goes to the oldest waiter of the node: the releasing process hands
it over when that waiter is its own, otherwise the process holding the waiter takes it at
its next poll (every ``POLL_S`` while it has waiters).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from gateway.errors import APIError
from shm.admission import NOBODY, AdmissionBoard, Others

Gate = Callable[[], APIError | None]
ReadyEngines = Callable[[], tuple[bool, ...]]
POLL_S = 0.005
"""How often a process with queued requests looks for slots freed by the other processes."""


class Admission:
    def __init__(
        self,
        max_active: int,
        max_queued: int,
        queue_timeout_s: float,
        retry_after_s: int,
        gate: Gate,
        board: AdmissionBoard | None = None,
        *,
        engines: int = 1,
        ready_engines: ReadyEngines | None = None,
    ) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self._retry_after_s = retry_after_s
        self._gate = gate
        self._board = board
        self.engines = engines
        self.per_engine = math.ceil(max_active / engines)
        """Most streams one engine takes (the node's limit split evenly)."""
        self._ready_engines: ReadyEngines = ready_engines or (lambda: (True,) * engines)
        self.by_engine = [0] * engines
        """Streams this process holds on each engine."""
        self._waiters: deque[tuple[asyncio.Future[int], int]] = deque()
        """This process's queued requests and their arrival times (monotonic ns)."""
        self._poller: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        """Streams this process holds (the node's: ``node_counts()``)."""
        return sum(self.by_engine)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def capacity(self) -> int:
        """Streams the node can hold now: its ready engines' shares, at most ``max_active``."""
        ready = sum(self._ready_engines())
        return min(self.max_active, self.per_engine * ready)

    def _place(self, others: Others) -> int | None:
        """The engine a new stream goes to, or None while no ready engine has room."""
        if self.active + others.active >= self.max_active:
            return None
        best: int | None = None
        best_load = 0
        for e, ready in enumerate(self._ready_engines()):
            if not ready or e >= self.engines:
                continue
            load = self.by_engine[e] + others.by_engine[e]
            if load < self.per_engine and (best is None or load < best_load):
                best, best_load = e, load
        return best

    @contextlib.contextmanager
    def _node(self) -> Iterator[Others]:
        """The other processes' counts, under the node's lock; this process's counts are
        published when the block ends."""
        if self._board is None:
            yield NOBODY
            return
        with self._board.locked():
            others = self._board.others()
            try:
                yield others
            finally:
                oldest = self._waiters[0][1] if self._waiters else 0
                self._board.publish(self.active, len(self._waiters), oldest, tuple(self.by_engine))

    def node_counts(self) -> tuple[int, int]:
        """Active and queued streams of the whole node."""
        with self._node() as others:
            return self.active + others.active, len(self._waiters) + others.queued

    def saturation(self) -> float:
        """The node's active streams over ``capacity()``, in 0..1: 1 when it can take no
        stream (no ready engine, or more streams than a shrunken capacity holds)."""
        capacity = self.capacity()
        if capacity <= 0:
            return 1.0
        return min(1.0, self.node_counts()[0] / capacity)

    @property
    def full(self) -> bool:
        return self.node_counts()[0] >= self.capacity()

    def _busy(self, code: str, message: str) -> APIError:
        return APIError(429, code, message, retry_after_s=self._retry_after_s)

    async def acquire(self) -> int:
        """Take a slot (waiting in the queue if needed) or raise ``APIError``. Returns the
        engine the stream is placed on; ``release`` it with the same engine."""
        refused = self._gate()
        if refused is not None:
            raise refused
        loop = asyncio.get_running_loop()
        with self._node() as others:
            nobody_waits = not self._waiters and not others.queued
            engine = self._place(others) if nobody_waits else None
            if engine is not None:
                self.by_engine[engine] += 1
                return engine
            if len(self._waiters) + others.queued >= self.max_queued:
                raise self._busy(
                    "server_busy",
                    f"all {self.capacity()} streams are busy and {self.max_queued} requests wait",
                )
            fut: asyncio.Future[int] = loop.create_future()
            self._waiters.append((fut, time.monotonic_ns()))
        if self._board is not None and (self._poller is None or self._poller.done()):
            self._poller = loop.create_task(self._poll(), name="admission-poll")
        timer = loop.call_later(self._queue_timeout_s, self._expire, fut)
        try:
            return await fut  # on success a slot was handed over (counted on its engine)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result())  # we were handed a slot just as we were cancelled
            raise
        finally:
            timer.cancel()
            self._forget(fut)

    def _forget(self, fut: asyncio.Future[int]) -> None:
        for i, (f, _) in enumerate(self._waiters):
            if f is fut:
                with self._node():
                    del self._waiters[i]
                return

    def _expire(self, fut: asyncio.Future[int]) -> None:
        if not fut.done():
            fut.set_exception(
                self._busy(
                    "queue_timeout",
                    f"no stream slot became free within {self._queue_timeout_s:g} s",
                )
            )

    def _grant(self, others: Others) -> None:
        """Hand free node slots to this process's waiters while they are the node's oldest."""
        while self._waiters and (engine := self._place(others)) is not None:
            fut, since = self._waiters[0]
            if fut.done():  # expired or cancelled; its acquire() forgets it
                self._waiters.popleft()
                continue
            if others.oldest_wait_ns and (others.oldest_wait_ns, others.oldest_index) < (
                since,
                self._board.index if self._board is not None else 0,
            ):
                return  # another process holds an older request: the slot is its
            self._waiters.popleft()
            self.by_engine[engine] += 1
            fut.set_result(engine)

    async def _poll(self) -> None:
        while self._waiters:
            await asyncio.sleep(POLL_S)
            with self._node() as others:
                self._grant(others)

    def release(self, engine: int = 0) -> None:
        """Give a slot on ``engine`` back; the node's oldest waiter takes it over."""
        with self._node() as others:
            self.by_engine[engine] -= 1
            self._grant(others)

    def reconsider(self) -> None:
        """An engine became ready: waiters may have room now."""
        with self._node() as others:
            self._grant(others)

    def refuse_waiting(self, error: APIError) -> None:
        """Fail every queued request with ``error`` (the gateway starts draining)."""
        with self._node():
            while self._waiters:
                fut, _ = self._waiters.popleft()
                if not fut.done():
                    fut.set_exception(error)

    def close(self) -> None:
        """Stop polling and give this process's slot on the node back."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self._board is not None:
            self._board.close()
            self._board = None
