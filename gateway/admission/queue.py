"""Admission control: at most as many streams as the node holds in real time, a bounded queue
behind them served fairly between API keys, and each admitted stream placed on one of the
node's vLLM engines.

The limit (``gateway.admission``): ``"learned"`` (the default) takes each engine's limit from
``gateway.admission.capacity`` (the streams that engine holds real-time, learned from the audio the
gateway receives), ``max_active`` being only a ceiling; ``"fixed"`` takes ``max_active`` split
over the engines. A lower limit only stops new admissions: admitted streams are never cut.

Waiting (learned): a request waits only as long as a real-time client can use
(``wait_budget``: the TTFB budget less the start time the engine needs now); one that could
not start within it (more requests ahead than the node finishes in that time) is refused at
once, with Retry-After. Per key: ``gateway.max_streams_per_key`` (and per-key overrides) caps
a key's streams (429 ``too_many_concurrent_requests`` at once: the key queues on its side),
those served from the sentence audio cache included (``hold_key``: they take no engine slot
and count in nothing else here, fair shares included).

Fair shares (issue 60), while more than one key has demand on the node: each key's share of
the node's capacity is its demand or its weighted part of an equal split among the keys with
demand, whichever is less (``gateway.admission.shares``, weights ``gateway.key_weights``); a key's
demand counts the streams it holds, its requests waiting and its requests refused lately
whose Retry-After has not run out twice (a light key sleeping out its Retry-After still
counts). Free slots go in turns: first to keys under their share, the one holding the fewest
streams per weight, then the one admitted least per weight over ``ADMITTED_WINDOW_S``, then
the one admitted longest ago; a slot whose turn is a key that is
only owed (refused lately, nothing waiting) is held for it until its client is back or its
refusal is forgotten. A key whose client came straight back last time (its next request
within ``RETURN_GRACE_S`` of its last stream's end: a closed-loop client, one request at a
time) is owed the slot its stream frees for that long too: without it, when that key's turn
comes, another key's waiter takes the slot in the milliseconds between its two requests and
holds it for a whole stream, longer than the returning request's wait budget (issue 60: one
light client at 68 % of its fair share). A request of a key at or over its share while
another key under its share has demand is refused at once with 429
``too_many_concurrent_requests`` (its share, not the node) and ``SHARE_RETRY_FACTOR`` times
the Retry-After; one of a key under its share waits for its turn within its wait budget.
Admitted streams are never cut: shares move only new admissions. With one key (or none named) nothing of this applies.

Early refusals (``gateway.early_refusal``): a key refused for the node (``server_busy``), its
share or its limit (``too_many_concurrent_requests``) is refused the same way, before its
next request's body is read (``refuse_early``, from the HTTP speech routes' middleware), while
nothing happened since that could let such a request in or change its answer (a slot freed,
a waiter left, a limit rose, an engine became ready: ``_moved``; another key's request
arrived: ``_arrived``) and for at most ``EARLY_REFUSAL_S`` (its
Retry-After if shorter): a flood's refusals then cost the HTTP exchange and not the body's
parsing and checks. It counts as the key's demand as any refusal does.

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
import bisect
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator

from gateway.admission.shares import fair_shares
from gateway.errors import APIError
from shm.admission import NO_COUNTS, NOBODY, AdmissionBoard, KeyCounts, Others, key_id

Gate = Callable[[], APIError | None]
ReadyEngines = Callable[[], tuple[bool, ...]]
WaitBudget = Callable[[], float]
POLL_S = 0.005
"""How often a process with queued requests looks for slots freed by the other processes."""
DEPARTURE_WINDOW_S = 10.0
"""Slots freed over this long estimate how fast the queue moves."""
ANONYMOUS = ""
"""The key of requests that carry none (no ``gateway.api_keys``)."""
SHARE_RETRY_FACTOR = 2
"""A key refused for its share hears this many times ``retry_after_s``: the node is not
full for the others, the key is over its part of it."""
ADMITTED_WINDOW_S = 30.0
"""A key's turns count its streams admitted over this long (divided by its weight): on a
node that holds one stream, weights 3:1 give three turns to one."""
REMEMBER_NS = int(ADMITTED_WINDOW_S * 1e9)
"""A key that holds, waits for and is owed nothing is remembered (its admissions: its place
in the turns) this long after its last admission."""
OWED_FOR = 2.0
"""A refused request counts as its key's demand for this many times its Retry-After (its
client sleeps it out and comes back), or until the key's next request arrives."""
RETURN_GRACE_S = 0.25
"""A key that came back within this long after its last stream ended is owed the slot its
next stream end frees for this long (``_returned``, ``release``). Long enough for a client's
next request to arrive and be read; short enough that a key that does not come back costs
the others a quarter of a second of one slot."""
RETURN_GRACE_NS = int(RETURN_GRACE_S * 1e9)
EARLY_REFUSAL_S = 1.0
"""The longest a refusal is repeated before the next request's body is read (``refuse_early``):
what may change without an event (a light key's refusals forgotten, the wait budget, the
departure rate) changes the verdict within it rarely, and only for the next request."""
EARLY_CODES = frozenset({"server_busy", "too_many_concurrent_requests"})
"""The refusals ``refuse_early`` repeats: those decided on arrival from the node's state
(not a wait that ran out, ``queue_timeout``, nor the gate's 503)."""


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


class _Standing:
    """One key's standing on the node while shares are in play (built per decision)."""

    __slots__ = (
        "admitted",
        "held",
        "here",
        "key",
        "last",
        "owed",
        "share",
        "since",
        "there",
        "weight",
    )

    def __init__(
        self, key: str | None, counts: KeyCounts, here: int, weight: float, since: int
    ) -> None:
        self.key = key
        """The key (None: a key only the other gateway processes know)."""
        self.held = counts.active
        self.here = here
        """Its requests waiting in this process."""
        self.there = counts.queued - here
        """Its requests waiting in the other processes."""
        self.owed = counts.refused
        self.weight = weight
        self.last = counts.last_admit_ns
        self.admitted = counts.admitted
        self.since = since
        self.share = 0.0

    def demand(self, limit: int) -> int:
        n = self.held + self.here + self.there + self.owed
        return min(n, limit) if limit else n

    def wants(self) -> bool:
        """It has a request waiting, or is owed a slot (refused lately, under its share)."""
        return self.here + self.there > 0 or (self.owed > 0 and self.held < self.share)

    def turn(self) -> tuple[bool, float, float, int, int]:
        """Its place in the turns (lowest first): under its share before over, fewer streams
        per weight held, then admitted lately, admitted longer ago, waiting longer."""
        w = self.weight
        return (self.held >= self.share, self.held / w, self.admitted / w, self.last, self.since)


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
        key_weights: dict[str, float] | None = None,
        early_refusal: bool = False,
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
        weights = key_weights or {}
        self._weights = {key_id(k): w for k, w in weights.items()}
        """``gateway.key_weights`` by board id (a key another process names is found so)."""
        self._owed: dict[str, deque[int]] = {}
        """Per key, when each of its lately refused requests (and a returning key's freed
        slot, ``release``) stops counting as demand (ns, in order)."""
        self._left: dict[str, int] = {}
        """When each key's last stream in this process ended, leaving it none (ns)."""
        self._returning: set[str] = set()
        """Keys whose last request came within ``RETURN_GRACE_S`` of their last stream's end."""
        self._last_admit: dict[str, int] = {}
        """When this process last admitted a stream of each key it knows (monotonic ns)."""
        self._admitted: dict[str, deque[int]] = {}
        """When this process admitted each key's streams, over ``ADMITTED_WINDOW_S`` (ns)."""
        self.shares: dict[str, float] = {}
        """The share of each key this process knows, as the last contended decision set it
        (empty while at most one key has demand)."""
        self.by_key: dict[str, int] = {}
        """Streams this process holds an engine slot for, per API key (keys with none are not
        kept): what the key's share and turns count."""
        self.slotless_by_key: dict[str, int] = {}
        """Streams this process serves with no engine slot, per API key (the sentence audio
        cache's hits, ``hold_key``): they count in the key's concurrency only."""
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
        self._regrant: asyncio.TimerHandle | None = None
        """Hands out again, once a held slot's owed key is forgotten, what waiters here could
        not take while it was held (no event may come meanwhile: ``_hold_until_forgotten``)."""
        self.early_refusal = early_refusal
        """Repeat a key's refusal before its next request's body is read (``refuse_early``)."""
        self._moves = 0
        """Counts what may let a refused request in (``_moved``): a repeated refusal holds
        only while it is unchanged."""
        self._refusals: dict[str, tuple[APIError, int, float, tuple[int, int]]] = {}
        """Per key, its last refusal decided on arrival (``EARLY_CODES``): the error, ``_moves``
        then, until when it may be repeated (monotonic s), the other processes' (active,
        queued) then."""
        self.early_refusals = 0
        """Refusals repeated before a body was read (this process)."""

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
            if fresh and min(fresh) != self.limits[e]:
                if min(fresh) > self.limits[e]:
                    self._moved()
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

    def _key_counts(self, now_ns: int) -> dict[int, KeyCounts]:
        """This process's counts by key id, for the board; forgets the keys that hold, wait
        for and are owed nothing."""
        counts: dict[int, KeyCounts] = {}
        for key in list(self._ids):
            held, waiting, owed = self.by_key.get(key, 0), self._queued_of(key), 0
            slotless = self.slotless_by_key.get(key, 0)
            if key in self._owed:
                owed = self._owed_of(key, now_ns)
            last = self._last_admit.get(key, 0)
            if held or waiting or owed or slotless or now_ns - last < REMEMBER_NS:
                counts[self._ids[key]] = KeyCounts(
                    held, waiting, owed, last, self._admitted_of(key, now_ns), slotless
                )
            else:
                del self._ids[key]
                self._last_admit.pop(key, None)
                self._admitted.pop(key, None)
                self._left.pop(key, None)
                self._returning.discard(key)
        return counts

    def _admitted_of(self, key: str, now_ns: int) -> int:
        """``key``'s streams admitted here over the last ``ADMITTED_WINDOW_S``."""
        d = self._admitted.get(key)
        if d is None:
            return 0
        while d and now_ns - d[0] > REMEMBER_NS:
            d.popleft()
        return len(d)

    def _owed_of(self, key: str, now_ns: int) -> int:
        """``key``'s refused requests still counted as demand (the forgotten ones dropped)."""
        d = self._owed.get(key)
        if d is None:
            return 0
        while d and d[0] <= now_ns:
            d.popleft()
        if not d:
            del self._owed[key]
            return 0
        return len(d)

    def _owe(self, key: str, error: APIError) -> APIError:
        """``key``'s request is refused with ``error``: count it as the key's demand while its
        client sleeps out the Retry-After."""
        wait_ns = int(OWED_FOR * (error.retry_after_s or self._retry_after_s) * 1e9)
        self._owe_until(key, time.monotonic_ns() + wait_ns)
        return error

    def _owe_until(self, key: str, until_ns: int) -> None:
        """Count one more request of ``key`` as its demand until ``until_ns``."""
        d = self._owed.get(key)
        if d is None:
            d = self._owed[key] = deque()
        bisect.insort(d, until_ns)  # a returning key's grace may end before a refusal's
        self._id(key)

    def _came_back(self, key: str, now_ns: int) -> None:
        """A request of ``key`` arrived: one of its refused clients is back (the earliest
        owed); whether it came straight back after its last stream is remembered."""
        if self._owed_of(key, now_ns):
            self._owed[key].popleft()
        left = self._left.pop(key, None)
        if left is not None:
            if now_ns - left <= RETURN_GRACE_NS:
                self._returning.add(key)
            else:
                self._returning.discard(key)

    @contextlib.contextmanager
    def _node(self, key: str | None = None) -> Iterator[Others]:
        """The other processes' counts, with those of ``key`` and of every key waiting here,
        under the node's lock; this process's counts are published when the block ends."""
        if key is not None:
            self._id(key)
        if self._board is None:
            yield NOBODY
            return
        with self._board.locked():
            others = self._board.others(every=True)
            try:
                yield others
            finally:
                self.keys_unpublished = self._board.publish(
                    self.active,
                    self._queued,
                    self._oldest(),
                    tuple(self.by_engine),
                    tuple(self.opinions) if self.learned else (),
                    self._key_counts(time.monotonic_ns()),
                )

    def _theirs(self, key: str, others: Others) -> KeyCounts:
        """``key``'s (active, queued) streams in the other processes."""
        kid = self._ids.get(key)
        return others.keys.get(kid, NO_COUNTS) if kid is not None else NO_COUNTS

    def _node_held(self, key: str, others: Others) -> int:
        """Streams ``key`` holds on the node (active, every process)."""
        return self.by_key.get(key, 0) + self._theirs(key, others)[0]

    def _node_streams_of(self, key: str, others: Others) -> int:
        """Streams ``key`` holds and waits for on the node, those with no engine slot (cache
        hits) included: what its concurrency limit counts."""
        theirs = self._theirs(key, others)
        here = self.by_key.get(key, 0) + self.slotless_by_key.get(key, 0) + self._queued_of(key)
        return here + theirs.active + theirs.slotless + theirs.queued

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

    def _busy(
        self, code: str, message: str, current: int, retry_after_s: int | None = None
    ) -> APIError:
        return APIError(
            429,
            code,
            message,
            retry_after_s=retry_after_s or self._retry_after_s,
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

    def _share_busy(self, mine: _Standing, capacity: int) -> APIError:
        return APIError(
            429,
            "too_many_concurrent_requests",
            f"this API key holds {mine.held} streams, its fair share of the "
            f"{capacity} the node holds now ({mine.share:.2f}) while other keys wait; "
            f"retry later",
            retry_after_s=SHARE_RETRY_FACTOR * self._retry_after_s,
            headers={
                "current-concurrent-requests": str(mine.held),
                "maximum-concurrent-requests": str(max(1, math.ceil(mine.share))),
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
        response): it takes a slot under the ceiling at once, whatever the learned limit,
        the shares and the queue say, and so an admitted stream is never cut."""
        refused = self._gate()
        if refused is not None:
            raise refused
        if continuing:
            self._continued(key)
            with self._node() as others:
                engine = self._place(others, ceiling=True)
                if engine is not None:
                    self._take(engine, key, turn=False)
                    return engine
        if self._refusals:
            self._arrived(key)
        key_limit = self._key_limits.of(key)
        loop = asyncio.get_running_loop()
        wait_s = self.wait_limit_s()
        now_ns = time.monotonic_ns()
        fut: asyncio.Future[int] = loop.create_future()
        with self._node(key) as others:
            try:
                self._came_back(key, now_ns)
                if key_limit and (held := self._node_streams_of(key, others)) >= key_limit:
                    raise self._key_busy(held, key_limit)
                if self.learned:
                    self._take_opinions(others)
                waiter = _Waiter(fut, key, now_ns)
                standings = self._standings(others, now_ns, waiter)
                if standings is None:
                    engine = self._admit_alone(key, others, wait_s, waiter)
                else:
                    engine = self._admit_shared(key, others, wait_s, waiter, standings)
            except APIError as e:
                self._remember(key, e, others)
                raise
            if engine is not None:
                return engine
        if self._board is not None and (self._poller is None or self._poller.done()):
            self._poller = loop.create_task(self._poll(), name="admission-poll")
        timer = loop.call_later(wait_s, self._expire, fut, wait_s, key)
        try:
            return await fut  # on success a slot was handed over (counted on its engine)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self.release(fut.result(), key)  # handed a slot just as we were cancelled
            raise
        finally:
            timer.cancel()
            self._forget(fut, key)

    def refuse_early(self, key: str = ANONYMOUS) -> APIError | None:
        """The refusal a new request of ``key`` hears before its body is read: its key's last
        refusal decided on arrival (``EARLY_CODES``), while nothing that could let such a
        request in happened since (``_moved``; with several gateway processes, the others'
        active and queued counts unchanged) and for at most ``EARLY_REFUSAL_S``; counted as
        the key's demand as ``acquire``'s refusals are. None: read the request and ``acquire``
        as usual (always, with ``early_refusal`` off)."""
        memo = self._refusals.get(key)
        if memo is None:
            return None
        error, moves, until, node = memo
        if moves != self._moves or time.monotonic() >= until or self._gate() is not None:
            del self._refusals[key]
            return None
        if self._board is not None:
            with self._board.locked():
                others = self._board.others()
            if (others.active, others.queued) != node:
                del self._refusals[key]
                return None
        self._came_back(key, time.monotonic_ns())
        self.early_refusals += 1
        again = APIError(
            error.status,
            error.code,
            error.message,
            param=error.param,
            retry_after_s=error.retry_after_s,
            headers=dict(error.extra_headers or {}),
        )
        return self._owe(key, again)

    def _remember(self, key: str, error: APIError, others: Others) -> None:
        """``acquire`` refused a request of ``key`` with ``error``: ``refuse_early`` may repeat
        it (a refusal decided on arrival, with ``early_refusal`` on)."""
        if not self.early_refusal or error.status != 429 or error.code not in EARLY_CODES:
            return
        now = time.monotonic()
        if len(self._refusals) >= 256:  # keys no client sent again lately
            for k in [k for k, m in self._refusals.items() if m[2] <= now]:
                del self._refusals[k]
        retry_after_s = error.retry_after_s or self._retry_after_s
        until = now + min(EARLY_REFUSAL_S, retry_after_s)
        self._refusals[key] = (error, self._moves, until, (others.active, others.queued))

    def _arrived(self, key: str) -> None:
        """A request of ``key`` arrived: its demand, and so the others' shares, may have
        moved; only ``key``'s own refusal may still be repeated early."""
        for k in [k for k in self._refusals if k != key]:
            del self._refusals[k]

    def _moved(self) -> None:
        """Something happened that may let in a request refused on arrival (a slot freed, a
        waiter left, a limit rose, an engine became ready): no refusal is repeated early."""
        self._moves += 1
        if self._refusals:
            self._refusals.clear()

    def _admit_alone(self, key: str, others: Others, wait_s: float, waiter: _Waiter) -> int | None:
        """At most one key has demand: a free slot while nobody waits, else the queue in
        arrival order (the key holding the fewest first) or a refusal. Returns the engine,
        or None with ``waiter`` queued."""
        nobody_waits = not self._queued and not others.queued
        engine = self._place(others) if nobody_waits else None
        if engine is not None:
            self._take(engine, key)
            return engine
        self._refuse_if_no_room(key, others, wait_s, "server_busy", self._retry_after_s)
        self._enqueue(waiter)
        return None

    def _refuse_if_no_room(
        self,
        key: str,
        others: Others,
        wait_s: float,
        code: str,
        retry_after_s: int,
        *,
        position: bool = True,
    ) -> None:
        """Raise (and owe the key) when the queue is full or, learned, when the request could
        not start within ``wait_s``."""
        waiting = self._queued + others.queued
        if waiting >= self.max_queued:
            raise self._owe(
                key,
                self._busy(
                    code,
                    f"all {self.capacity()} streams are busy and {self.max_queued} requests wait",
                    self.active + others.active,
                    retry_after_s,
                ),
            )
        if self.learned and position:
            starts = self._departure_rate(time.monotonic()) * wait_s
            if self._position(key, others) > max(1.0, starts):
                raise self._owe(
                    key,
                    self._busy(
                        code,
                        f"all {self.capacity()} streams the node holds in real time are busy "
                        f"and {waiting} requests wait: this one could not start within "
                        f"{wait_s:.2f} s",
                        self.active + others.active,
                        retry_after_s,
                    ),
                )

    def _admit_shared(
        self,
        key: str,
        others: Others,
        wait_s: float,
        waiter: _Waiter,
        standings: list[_Standing],
    ) -> int | None:
        """Several keys have demand: the request takes its turn (``_grant_shared``) at once,
        waits for it, or is refused (its key over its share while another is under)."""
        mine = next(s for s in standings if s.key == key)
        over = mine.held + mine.here + mine.there - 1 >= mine.share
        self._enqueue(waiter)
        self._grant_shared(others, standings)
        if waiter.fut.done():
            return waiter.fut.result()
        self._dequeue(waiter)
        capacity = self.capacity()
        if over and any(s is not mine and s.wants() and s.held < s.share for s in standings):
            raise self._owe(key, self._share_busy(mine, capacity))
        if over and mine.share < capacity:
            code, retry_after_s = "too_many_concurrent_requests", self._retry_after_s
            retry_after_s *= SHARE_RETRY_FACTOR
        else:
            code, retry_after_s = "server_busy", self._retry_after_s
        # Under its share a request waits for its turn; over it, only if it could start in time.
        self._refuse_if_no_room(key, others, wait_s, code, retry_after_s, position=over)
        self._enqueue(waiter)
        return None

    def _standings(
        self, others: Others, now_ns: int, asking: _Waiter | None = None
    ) -> list[_Standing] | None:
        """Every key with demand on the node and its share of the capacity, or None while at
        most one key has demand (shares change nothing then). ``asking``: a request not yet
        queued, counted as its key's demand."""
        if self._board is None and len(self._ids) > 2 * len(self.by_key) + 8:
            self._key_counts(now_ns)  # forgets the keys done with (the board's publish does)
        if len(self._ids) + len(others.keys) < 2:
            return None
        out: list[_Standing] = []
        seen: set[int] = set()
        for key, kid in self._ids.items():
            q = self._queues.get(key)
            here = len(q) if q else 0
            counts = KeyCounts(
                self.by_key.get(key, 0),
                here,
                self._owed_of(key, now_ns),
                self._last_admit.get(key, 0),
                self._admitted_of(key, now_ns),
            )
            if asking is not None and asking.key == key:
                counts = counts._replace(queued=counts.queued + 1)
                here += 1
            theirs = others.keys.get(kid)
            if theirs is not None:
                counts = counts.merged(theirs)
                seen.add(kid)
            if counts.active + counts.queued + counts.refused:
                since = q[0].since if q else (asking.since if here else now_ns)
                out.append(_Standing(key, counts, here, self._weights.get(kid, 1.0), since))
        for kid, counts in others.keys.items():
            if kid not in seen and counts.active + counts.queued + counts.refused:
                out.append(_Standing(None, counts, 0, self._weights.get(kid, 1.0), now_ns))
        if len(out) < 2:
            return None
        demands = [s.demand(self._key_limits.of(s.key) if s.key is not None else 0) for s in out]
        for s, share in zip(
            out, fair_shares(self.capacity(), demands, [s.weight for s in out]), strict=True
        ):
            s.share = share
        self.shares = {s.key: s.share for s in out if s.key is not None}
        return out

    def _free(self, others: Others) -> int:
        """Slots the node has free now: under each ready engine's limit, under ``max_active``."""
        room = self.max_active - self.active - others.active
        free = 0
        for e, ready in enumerate(self._ready_engines()):
            if ready and e < self.engines:
                free += max(0, self._engine_limit(e) - self.by_engine[e] - others.by_engine[e])
        return max(0, min(room, free))

    def _grant_shared(self, others: Others, standings: list[_Standing]) -> None:
        """Hand the node's free slots out in turns (``_Standing.turn``): to this process's
        waiters whose turn it is; a turn of a key waiting in another process is left to it
        (its next poll), one of a key only owed is held for it."""
        free = self._free(others)
        while free > 0:
            best: _Standing | None = None
            for s in standings:
                if s.wants() and (best is None or s.turn() < best.turn()):
                    best = s
            if best is None:
                return
            if best.here:
                q = self._queues.get(best.key or "")
                while q and q[0].fut.done():  # expired or cancelled; its acquire() forgets it
                    q.popleft()
                    self._queued -= 1
                    best.here -= 1
                if not q:
                    self._drop_empty(best.key or "")
                    best.here = 0
                    continue
                engine = self._place(others)
                if engine is None:
                    return
                waiter = q.popleft()
                self._queued -= 1
                self._drop_empty(waiter.key)
                best.here -= 1
                self._take(engine, waiter.key)
                waiter.fut.set_result(engine)
            elif best.there:
                best.there -= 1
            else:
                best.owed -= 1  # held for its client, back within its Retry-After
                if best.key is not None and self._queued:
                    self._hold_until_forgotten(best.key)
            best.held += 1
            free -= 1

    def _hold_until_forgotten(self, key: str) -> None:
        """A slot is held for ``key``'s owed client while requests wait here: if the client is
        not back by the time its owed request is forgotten, the slot goes to them then (with
        several gateway processes the poll does it; alone, nothing else would until the next
        request or stream end)."""
        d = self._owed.get(key)
        if not d:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        at = loop.time() + max(0, d[0] - time.monotonic_ns()) / 1e9 + 0.001
        if self._regrant is not None:
            if self._regrant.when() <= at:
                return
            self._regrant.cancel()
        self._regrant = loop.call_at(at, self._grant_held)

    def _grant_held(self) -> None:
        self._regrant = None
        with self._node() as others:
            self._grant(others)

    def _position(self, key: str, others: Others) -> int:
        """Where a new request of ``key`` would be served in this process's queue: after its
        own key's waiting requests, and after the first request of every other waiting key
        that holds no more streams on the node than ``key`` will once those are served."""
        mine = self._queued_of(key)
        held = self._node_held(key, others) + mine
        ahead = sum(1 for k in self._queues if k != key and self._node_held(k, others) <= held)
        return mine + ahead + 1

    def _take(self, engine: int, key: str, *, turn: bool = True) -> None:
        """Count a slot on ``engine`` for ``key``; ``turn``: a new stream, which counts in
        the key's turns (the next sentence of an admitted response does not)."""
        self.by_engine[engine] += 1
        self.by_key[key] = self.by_key.get(key, 0) + 1
        self._id(key)
        if not turn:
            return
        now_ns = self._last_admit[key] = time.monotonic_ns()
        d = self._admitted.get(key)
        if d is None:
            d = self._admitted[key] = deque()
        d.append(now_ns)

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
        for w in q:
            if w.fut is fut:
                with self._node():
                    self._dequeue(w)
                    self._moved()  # a waiter left the queue: a new request may fit in it
                return

    def _dequeue(self, waiter: _Waiter) -> None:
        q = self._queues.get(waiter.key)
        if q is not None and waiter in q:
            q.remove(waiter)
            self._queued -= 1
            self._drop_empty(waiter.key)

    def _drop_empty(self, key: str) -> None:
        q = self._queues.get(key)
        if q is not None and not q:
            del self._queues[key]

    def _expire(self, fut: asyncio.Future[int], wait_s: float, key: str) -> None:
        if not fut.done():
            fut.set_exception(
                self._owe(
                    key,
                    self._busy(
                        "queue_timeout",
                        f"no stream slot became free within {wait_s:.2f} s",
                        self.active,
                    ),
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
        """Hand free node slots to this process's waiters: in turns while several keys have
        demand (``_grant_shared``), else the key holding the fewest streams first, while this
        process holds the node's oldest request."""
        standings = self._standings(others, time.monotonic_ns())
        if standings is not None:
            self._grant_shared(others, standings)
            return
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
        self._drop_key_stream(key)
        if key not in self.by_key:
            self._returned(key)
        self._moved()
        with self._node() as others:
            self.by_engine[engine] -= 1
            self._grant(others)

    # -- streams that take no engine slot (the sentence audio cache's hits) ----------------
    def hold_key(self, key: str = ANONYMOUS) -> None:
        """A stream of ``key`` served from the sentence audio cache: it takes no engine slot
        (the learned and fixed limits count synthesis only) but counts in the key's
        concurrency (``max_streams_per_key``), node-wide, and not in its fair share nor its
        turns (``slotless_by_key``: a key whose callers hear cached greetings is not the
        busier for it when it asks for synthesis). Raises ``APIError`` (the gate's 503, or
        429 ``too_many_concurrent_requests``); ``release_key`` it."""
        refused = self._gate()
        if refused is not None:
            raise refused
        key_limit = self._key_limits.of(key)
        with self._node(key) as others:
            if key_limit and (held := self._node_streams_of(key, others)) >= key_limit:
                raise self._key_busy(held, key_limit)
            self.slotless_by_key[key] = self.slotless_by_key.get(key, 0) + 1
            self._id(key)

    def release_key(self, key: str = ANONYMOUS) -> None:
        """The end of a ``hold_key`` stream."""
        n = self.slotless_by_key.get(key, 0) - 1
        if n > 0:
            self.slotless_by_key[key] = n
        else:
            self.slotless_by_key.pop(key, None)
        self._moved()  # a key held at its limit may be admitted now: no early refusal
        with self._node() as others:  # publishes the key's count to the other processes
            self._grant(others)  # a waiter of this key held at its limit may start now

    def _continued(self, key: str) -> None:
        """The next sentence of ``key``'s admitted response: the stream did not end, so the
        slot its sentence freed is not owed to it as a returning key's."""
        left = self._left.pop(key, None)
        if left is not None and key in self._returning and (d := self._owed.get(key)):
            with contextlib.suppress(ValueError):  # the grace's own entry (``_returned``)
                d.remove(left + RETURN_GRACE_NS)

    def _returned(self, key: str) -> None:
        """``key``'s last stream here ended: a key that came straight back last time is owed
        the slot for ``RETURN_GRACE_S`` (it counts only while shares are in play)."""
        now_ns = self._left[key] = time.monotonic_ns()
        if key in self._returning:
            self._owe_until(key, now_ns + RETURN_GRACE_NS)

    def _drop_key_stream(self, key: str) -> None:
        """One stream of ``key`` with a slot fewer in this process."""
        n = self.by_key.get(key, 0) - 1
        if n > 0:
            self.by_key[key] = n
        else:
            self.by_key.pop(key, None)

    def reconsider(self) -> None:
        """An engine became ready: waiters may have room now."""
        self._moved()
        with self._node() as others:
            self._grant(others)

    def refuse_waiting(self, error: APIError) -> None:
        """Fail every queued request with ``error`` (the gateway starts draining)."""
        self._moved()
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
