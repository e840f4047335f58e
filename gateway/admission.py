"""Admission control: at most as many streams as the node holds in real time, a bounded queue
behind them served fairly between API keys, and each admitted stream placed on one of the
node's vLLM engines.

The limit (``gateway.admission``): ``"learned"`` (the default) takes each engine's limit from
``gateway.capacity`` (the streams that engine holds real-time, learned from the audio the
gateway receives), ``max_active`` being only a ceiling; ``"fixed"`` takes ``max_active`` split
over the engines. A lower limit only stops new admissions: admitted streams are never cut.

Waiting (learned): a request waits only as long as a real-time client can use
(``wait_budget``: the TTFB budget less the start time the engine needs now); one that could
not start within it (more requests ahead than the node finishes in that time) is refused at
once, with Retry-After. Per key: ``gateway.max_streams_per_key`` (and per-key overrides) caps
a key's streams (429 ``too_many_concurrent_requests`` at once: the key queues on its side);
when the node is full, a freed slot goes to the waiting request of the key that holds the
fewest streams, so a key that floods is served after every key that holds less than it.

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
its next poll (every ``POLL_S`` while it has waiters). A key's streams are the node's too: each
process publishes its streams and waiters per key on the board, so a key's limit and its
place in the fair order count what it holds in every gateway process.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from gateway.errors import APIError
from shm.admission import NOBODY, AdmissionBoard, KeyCounts, Others, key_id

Gate = Callable[[], APIError | None]
ReadyEngines = Callable[[], tuple[bool, ...]]
WaitBudget = Callable[[], float]
POLL_S = 0.005
"""How often a process with queued requests looks for slots freed by the other processes."""
DEPARTURE_WINDOW_S = 10.0
"""Slots freed over this long estimate how fast the queue moves."""
ANONYMOUS = ""
"""The key of requests that carry none (no ``gateway.api_keys``)."""


class KeyLimits:
    """Streams one API key may hold at once: ``default`` (0: no limit) unless ``overrides``
    names the key."""

    def __init__(self, default: int = 0, overrides: dict[str, int] | None = None) -> None:
        self.default = default
        self.overrides = dict(overrides or {})

    def of(self, key: str) -> int:
        return self.overrides.get(key, self.default)


class _Waiter:
    __slots__ = ("fut", "key", "since")

    def __init__(self, fut: asyncio.Future[int], key: str, since: int) -> None:
        self.fut = fut
        self.key = key
        self.since = since


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
        learned: bool = False,
        initial_limit: int = 1,
        wait_budget: WaitBudget | None = None,
        key_limits: KeyLimits | None = None,
    ) -> None:
        self.max_active = max_active
        self.max_queued = max_queued
        self._queue_timeout_s = queue_timeout_s
        self._retry_after_s = retry_after_s
        self._gate = gate
        self._board = board
        self.engines = engines
        self.per_engine = math.ceil(max_active / engines)
        """Most streams one engine takes (the node's ceiling split evenly)."""
        self._ready_engines: ReadyEngines = ready_engines or (lambda: (True,) * engines)
        self.by_engine = [0] * engines
        """Streams this process holds on each engine."""
        self.learned = learned
        self.opinions = [0] * engines
        """This process's learned limit of each engine (0: no fresh opinion); the node's is
        the lowest fresh opinion of its gateway processes (``limits``)."""
        self.limits = [
            min(self.per_engine, initial_limit) if learned else self.per_engine
        ] * engines
        """Each engine's limit in force (learned: the node's opinion, at most its share)."""
        self._wait_budget = wait_budget
        self._key_limits = key_limits or KeyLimits()
        self.by_key: dict[str, int] = {}
        """Streams this process holds per API key (keys with none are not kept)."""
        self._ids: dict[str, int] = {}
        """Board ids (``shm.admission.key_id``) of the keys this process holds or queues."""
        self.keys_unpublished = 0
        """Keys the last publish could not fit on the board (counted only in this process)."""
        self._queues: dict[str, deque[_Waiter]] = {}
        """This process's queued requests, per key, in arrival order."""
        self._queued = 0
        self._departures: deque[float] = deque()
        """When slots were freed (monotonic s), over the last ``DEPARTURE_WINDOW_S``."""
        self._poller: asyncio.Task[None] | None = None

    @property
    def active(self) -> int:
        """Streams this process holds (the node's: ``node_counts()``)."""
        return sum(self.by_engine)

    @property
    def queued(self) -> int:
        return self._queued

    def _oldest(self) -> int:
        return min((q[0].since for q in self._queues.values() if q), default=0)

    def _engine_limit(self, e: int) -> int:
        if not self.learned:
            return self.per_engine
        return min(self.per_engine, self.limits[e])

    def capacity(self) -> int:
        """Streams the node can hold now: its ready engines' limits, at most ``max_active``."""
        ready = self._ready_engines()
        total = sum(self.limits[e] if self.learned else self.per_engine
                    for e in range(self.engines) if e < len(ready) and ready[e])  # fmt: skip
        return min(self.max_active, total)

    def learn(self, opinions: list[int]) -> None:
        """This process's learned limit per engine (0 where it has no fresh evidence); the
        limits in force become the node's (the lowest fresh opinion of any gateway)."""
        self.opinions = [max(0, min(self.per_engine, n)) for n in opinions]
        with self._node() as others:
            self._take_opinions(others)
            self._grant(others)  # a risen limit may admit a waiter now

    def _take_opinions(self, others: Others) -> None:
        for e in range(self.engines):
            own = self.opinions[e]
            other = others.limits[e] if e < len(others.limits) else 0
            fresh = [n for n in (own, other) if n > 0]
            if fresh:
                self.limits[e] = min(fresh)

    def _place(self, others: Others, *, ceiling: bool = False) -> int | None:
        """The engine a new stream goes to, or None while no ready engine has room (under
        its limit; with ``ceiling``, under its share of ``max_active``)."""
        if self.active + others.active >= self.max_active:
            return None
        best: int | None = None
        best_load = 0
        for e, ready in enumerate(self._ready_engines()):
            if not ready or e >= self.engines:
                continue
            load = self.by_engine[e] + others.by_engine[e]
            limit = self.per_engine if ceiling else self._engine_limit(e)
            if load < limit and (best is None or load < best_load):
                best, best_load = e, load
        return best

    def _id(self, key: str) -> int:
        kid = self._ids.get(key)
        if kid is None:
            kid = self._ids[key] = key_id(key)
        return kid

    def _key_counts(self) -> dict[int, KeyCounts]:
        """This process's (active, queued) streams by key id, for the board; forgets the ids
        of keys that hold and wait for nothing."""
        counts: dict[int, KeyCounts] = {}
        for key in list(self._ids):
            held, waiting = self.by_key.get(key, 0), self._queued_of(key)
            if held or waiting:
                counts[self._ids[key]] = (held, waiting)
            else:
                del self._ids[key]
        return counts

    @contextlib.contextmanager
    def _node(self, key: str | None = None) -> Iterator[Others]:
        """The other processes' counts, with those of ``key`` and of every key waiting here,
        under the node's lock; this process's counts are published when the block ends."""
        if self._board is None:
            yield NOBODY
            return
        asked: Iterable[int] = [self._id(k) for k in self._queues]
        if key is not None:
            asked = [*asked, self._id(key)]
        with self._board.locked():
            others = self._board.others(asked)
            try:
                yield others
            finally:
                self.keys_unpublished = self._board.publish(
                    self.active,
                    self._queued,
                    self._oldest(),
                    tuple(self.by_engine),
                    tuple(self.opinions) if self.learned else (),
                    self._key_counts(),
                )

    def _theirs(self, key: str, others: Others) -> KeyCounts:
        """``key``'s (active, queued) streams in the other processes."""
        kid = self._ids.get(key)
        return others.keys.get(kid, (0, 0)) if kid is not None else (0, 0)

    def _node_held(self, key: str, others: Others) -> int:
        """Streams ``key`` holds on the node (active, every process)."""
        return self.by_key.get(key, 0) + self._theirs(key, others)[0]

    def _node_streams_of(self, key: str, others: Others) -> int:
        """Streams ``key`` holds and waits for on the node."""
        return self._node_held(key, others) + self._queued_of(key) + self._theirs(key, others)[1]

    def node_counts(self) -> tuple[int, int]:
        """Active and queued streams of the whole node."""
        with self._node() as others:
            return self.active + others.active, self._queued + others.queued

    def node_by_engine(self) -> list[int]:
        """The node's active streams on each engine."""
        with self._node() as others:
            return [self.by_engine[e] + others.by_engine[e] for e in range(self.engines)]

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

    def _busy(self, code: str, message: str, current: int) -> APIError:
        return APIError(
            429,
            code,
            message,
            retry_after_s=self._retry_after_s,
            headers={
                "current-concurrent-requests": str(current),
                "maximum-concurrent-requests": str(self.capacity()),
            },
        )

    def _key_busy(self, held: int, limit: int) -> APIError:
        return APIError(
            429,
            "too_many_concurrent_requests",
            f"this API key already has {held} streams open, its limit "
            f"(gateway.max_streams_per_key); wait for one to end",
            retry_after_s=self._retry_after_s,
            headers={
                "current-concurrent-requests": str(held),
                "maximum-concurrent-requests": str(limit),
            },
        )

    def wait_limit_s(self) -> float:
        """How long a request may wait for a slot (learned: what the TTFB budget leaves)."""
        if self._wait_budget is None:
            return self._queue_timeout_s
        return min(self._queue_timeout_s, self._wait_budget())

    def _departure_rate(self, now: float) -> float:
        """Slots freed per second lately (this process's)."""
        d = self._departures
        while d and now - d[0] > DEPARTURE_WINDOW_S:
            d.popleft()
        if not d:
            return 0.0
        return len(d) / max(now - d[0], 1.0)

    async def acquire(self, key: str = ANONYMOUS, *, continuing: bool = False) -> int:
        """Take a slot (waiting in the queue if needed) or raise ``APIError``. Returns the
        engine the stream is placed on; ``release`` it with the same engine and key.
        ``continuing``: the request continues an admitted stream (the next sentence of one
        response): it takes a slot under the ceiling at once, whatever the learned limit
        and the queue say, and so an admitted stream is never cut."""
        refused = self._gate()
        if refused is not None:
            raise refused
        if continuing:
            with self._node() as others:
                engine = self._place(others, ceiling=True)
                if engine is not None:
                    self._take(engine, key)
                    return engine
        key_limit = self._key_limits.of(key)
        loop = asyncio.get_running_loop()
        wait_s = self.wait_limit_s()
        with self._node(key) as others:
            if key_limit and (held := self._node_streams_of(key, others)) >= key_limit:
                raise self._key_busy(held, key_limit)
            if self.learned:
                self._take_opinions(others)
            nobody_waits = not self._queued and not others.queued
            engine = self._place(others) if nobody_waits else None
            if engine is not None:
                self._take(engine, key)
                return engine
            waiting = self._queued + others.queued
            if waiting >= self.max_queued:
                raise self._busy(
                    "server_busy",
                    f"all {self.capacity()} streams are busy and {self.max_queued} requests wait",
                    self.active + others.active,
                )
            if self.learned:
                starts = self._departure_rate(time.monotonic()) * wait_s
                if self._position(key, others) > max(1.0, starts):
                    raise self._busy(
                        "server_busy",
                        f"all {self.capacity()} streams the node holds in real time are busy "
                        f"and {waiting} requests wait: this one could not start within "
                        f"{wait_s:.2f} s",
                        self.active + others.active,
                    )
            fut: asyncio.Future[int] = loop.create_future()
            self._enqueue(_Waiter(fut, key, time.monotonic_ns()))
        if self._board is not None and (self._poller is None or self._poller.done()):
            self._poller = loop.create_task(self._poll(), name="admission-poll")
        timer = loop.call_later(wait_s, self._expire, fut, wait_s)
        try:
            return await fut  # on success a slot was handed over (counted on its engine)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), key)  # handed a slot just as we were cancelled
            raise
        finally:
            timer.cancel()
            self._forget(fut, key)

    def _position(self, key: str, others: Others) -> int:
        """Where a new request of ``key`` would be served in this process's queue: after its
        own key's waiting requests, and after the first request of every other waiting key
        that holds no more streams on the node than ``key`` will once those are served."""
        mine = self._queued_of(key)
        held = self._node_held(key, others) + mine
        ahead = sum(1 for k in self._queues if k != key and self._node_held(k, others) <= held)
        return mine + ahead + 1

    def _take(self, engine: int, key: str) -> None:
        self.by_engine[engine] += 1
        self.by_key[key] = self.by_key.get(key, 0) + 1
        self._id(key)

    def _queued_of(self, key: str) -> int:
        q = self._queues.get(key)
        return len(q) if q else 0

    def _enqueue(self, waiter: _Waiter) -> None:
        q = self._queues.get(waiter.key)
        if q is None:
            q = self._queues[waiter.key] = deque()
        q.append(waiter)
        self._queued += 1

    def _forget(self, fut: asyncio.Future[int], key: str) -> None:
        q = self._queues.get(key)
        if not q:
            return
        for i, w in enumerate(q):
            if w.fut is fut:
                with self._node():
                    del q[i]
                    self._queued -= 1
                    self._drop_empty(key)
                return

    def _drop_empty(self, key: str) -> None:
        q = self._queues.get(key)
        if q is not None and not q:
            del self._queues[key]

    def _expire(self, fut: asyncio.Future[int], wait_s: float) -> None:
        if not fut.done():
            fut.set_exception(
                self._busy(
                    "queue_timeout",
                    f"no stream slot became free within {wait_s:.2f} s",
                    self.active,
                )
            )

    def _next_waiter(self, others: Others) -> _Waiter | None:
        """The waiter whose turn it is: the oldest request of the waiting key that holds the
        fewest streams on the node (ties: the key with fewer requests waiting, then the older
        request).
        Waiters that expired or were cancelled are dropped on the way. O(waiting keys): a
        few per process."""
        best: _Waiter | None = None
        best_rank = (0, 0, 0)
        for key in list(self._queues):
            q = self._queues[key]
            while q and q[0].fut.done():  # expired or cancelled; its acquire() forgets it
                q.popleft()
                self._queued -= 1
            if not q:
                del self._queues[key]
                continue
            rank = (self._node_held(key, others), len(q), q[0].since)
            if best is None or rank < best_rank:
                best, best_rank = q[0], rank
        return best

    def _grant(self, others: Others) -> None:
        """Hand free node slots to this process's waiters, the key holding the fewest streams
        first, while this process holds the node's oldest request."""
        while (waiter := self._next_waiter(others)) is not None:
            engine = self._place(others)
            if engine is None:
                return
            if others.oldest_wait_ns and (others.oldest_wait_ns, others.oldest_index) < (
                self._oldest(),
                self._board.index if self._board is not None else 0,
            ):
                return  # another process holds an older request: the slot is its
            key = waiter.key
            q = self._queues[key]
            q.popleft()
            self._queued -= 1
            if not q:
                del self._queues[key]
            self._take(engine, key)
            waiter.fut.set_result(engine)

    async def _poll(self) -> None:
        while self._queued:
            await asyncio.sleep(POLL_S)
            with self._node() as others:
                if self.learned:
                    self._take_opinions(others)
                self._grant(others)

    def release(self, engine: int = 0, key: str = ANONYMOUS) -> None:
        """Give a slot on ``engine`` back; the node's oldest waiter takes it over."""
        now = time.monotonic()
        d = self._departures
        d.append(now)
        while now - d[0] > DEPARTURE_WINDOW_S:
            d.popleft()
        n = self.by_key.get(key, 0) - 1
        if n > 0:
            self.by_key[key] = n
        else:
            self.by_key.pop(key, None)
        with self._node() as others:
            self.by_engine[engine] -= 1
            self._grant(others)

    # -- streams that take no engine slot (the sentence audio cache's hits) ----------------
    def hold_key(self, key: str = ANONYMOUS) -> None:
        """A stream of ``key`` served from the sentence audio cache: it takes no engine slot
        (the learned and fixed limits count synthesis only) but counts in the key's
        concurrency (``max_streams_per_key``), node-wide. Raises ``APIError`` (the gate's
        503, or 429 ``too_many_concurrent_requests``); ``release_key`` it."""
        refused = self._gate()
        if refused is not None:
            raise refused
        key_limit = self._key_limits.of(key)
        with self._node(key) as others:
            if key_limit and (held := self._node_streams_of(key, others)) >= key_limit:
                raise self._key_busy(held, key_limit)
            self.by_key[key] = self.by_key.get(key, 0) + 1
            self._id(key)

    def release_key(self, key: str = ANONYMOUS) -> None:
        """The end of a ``hold_key`` stream."""
        n = self.by_key.get(key, 0) - 1
        if n > 0:
            self.by_key[key] = n
        else:
            self.by_key.pop(key, None)
        with self._node() as others:
            self._grant(others)  # a waiter of this key may start now

    def reconsider(self) -> None:
        """An engine became ready: waiters may have room now."""
        with self._node() as others:
            self._grant(others)

    def refuse_waiting(self, error: APIError) -> None:
        """Fail every queued request with ``error`` (the gateway starts draining)."""
        with self._node():
            for q in self._queues.values():
                for w in q:
                    if not w.fut.done():
                        w.fut.set_exception(error)
                q.clear()
            self._queues.clear()
            self._queued = 0

    def close(self) -> None:
        """Stop polling and give this process's slot on the node back."""
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self._board is not None:
            self._board.close()
            self._board = None
