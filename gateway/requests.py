"""The life of a speech request in the gateway: admitted, streamed to its client, finished.

``RequestTracker`` is the one owner of that life (``Gateway.requests``). A front end opens a
request on its connection's ``ClientLink`` (``gateway.link``) and drives the
``ActiveRequest`` it gets::

    async with gateway.requests.open(params, link) as request:
        while chunks := await request.stream.next_chunks():
            await link.write(resp.write(data), len(data), request)
        request.complete()

Entering admits the request (or raises ``APIError`` 429/503) and places it on an engine
(``gateway.admission``), opens its stream in the registry and has ``gateway.upstream`` (the
one sender of a stream's submit, appends and cancel, all to that engine) submit it; leaving
frees the slot, lets the stream go (if its worker stream had not ended, the registry's
``on_leave`` has ``gateway.upstream`` cancel it), records the outcome (``outcome_of``), the
metrics and the stream's log line.

The contract is split by lifetime: the connection's ``ClientLink`` owns every write (the
stall watchdog's clock, the bytes, the abort), the request owns admission, its stream, its
outcome and its time to first audio (``first_audio``, told by the link when the first of
its audio reaches the client: while it streams, or after it ended for audio held past it).
``complete`` records that the client has everything (else the outcome is ``cancelled``).

Tracing (``common.tracing``, when on): a request is one ``tts.request`` span (continuing the
client's W3C ``traceparent``: the ``traceparent`` argument of ``open``, else the HTTP header
the app's middleware put in ``INCOMING_TRACEPARENT``) with its queue wait as an attribute, a
child ``gateway.admission`` span when it waited (5 ms or more) or was refused, and a
``first_audio_byte`` event (``first_audio``); ``LlmSubmit`` carries its context to the llm
worker. Tracing off: ``tracing`` is None and no span is made.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextvars import ContextVar
from types import TracebackType
from typing import TYPE_CHECKING

from common.config.gateway import GatewayConfig
from gateway.admission.queue import Admission
from gateway.cache.control import USE, CacheUse
from gateway.cache.relay import FlightTail
from gateway.cache.units import sentences
from gateway.errors import APIError
from gateway.link import ClientLink
from gateway.metrics import GatewayMetrics
from gateway.schemas import SpeechParams, check_text
from gateway.streams import PcmStream, StreamRegistry
from gateway.text.breaks import has_breaks, split_breaks
from gateway.text.pauses import Runs, Silence
from gateway.upstream import Upstream, UpstreamUnavailable
from shm.records import SAMPLE_RATE, SAMPLES_PER_FRAME, StreamEnd, StreamError

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from common.tracing import Tracing
    from gateway.cache.flight import Joined
    from gateway.cache.keys import UnitKey
    from gateway.cache.service import AudioCache

stream_log = logging.getLogger("orpheus.streams")

BYTES_PER_SECOND = SAMPLE_RATE * 2
PCM_FRAME_BYTES = SAMPLES_PER_FRAME * 2
HIT_CHUNK_BYTES = BYTES_PER_SECOND // 2
"""A cache hit's PCM goes to its front end in pieces of half a second (encoders and
socket messages work chunk by chunk)."""
MAX_SENTENCE_LOOKUPS = 16
"""Sentences of one text looked up at most (its cached start); the rest is synthesised."""
STORED_ENDS = frozenset({"stop", "length"})
"""How a unit's worker stream must have ended for the cache to store its audio."""

_SPAN_FIELDS = ("engine", "ttfb_s", "rtf", "audio_s", "bytes_sent", "text_chars")
"""The stream log line's fields that the request's span gets at its end (the others it has)."""
QUEUED_SPAN_NS = 5_000_000
"""Tracing: an admission that took this long (it waited in the queue, or the event loop was
late) gets a span of its own; a free slot costs none."""

INCOMING_TRACEPARENT: ContextVar[str | None] = ContextVar("incoming_traceparent", default=None)
"""The W3C ``traceparent`` header of the HTTP request being served (set by the app's tracing
middleware, only when tracing is on): ``RequestTracker.open``'s default."""


def outcome_of(error: StreamError) -> str:
    """The ``outcome`` label of a stream that failed with ``error``."""
    if error.code in ("slow_client", "worker_restarted", "shutdown"):
        return error.code
    if error.code in ("cancelled", "client_disconnected"):
        return "cancelled"
    if error.code == "upstream_timeout":
        return "timeout"
    return "bad_request" if 400 <= error.status < 500 else "upstream_error"


def request_outcome(request: ActiveRequest, exc: BaseException | None) -> str:
    """The ``outcome`` label of a request that is being left (with ``exc``, if raised)."""
    if request.completed:
        return "ok"
    if request.stream.error is not None:
        return outcome_of(request.stream.error)
    if exc is None or isinstance(exc, asyncio.CancelledError | ConnectionError):
        return "cancelled"
    if isinstance(exc, APIError):
        return "bad_request" if exc.status < 500 else "upstream_error"
    return "internal_error"


class ActiveRequest:
    """One request, as a front end drives it (see the module docstring). An async context
    manager: entering admits it, leaving finishes it (``RequestTracker``)."""

    __slots__ = (
        "_tracker",
        "api",
        "bytes_sent",
        "cache_key",
        "cache_prefix",
        "cache_rest",
        "cache_state",
        "cache_tenant",
        "cache_use",
        "completed",
        "first_byte_at",
        "flight_leader",
        "link",
        "params",
        "runs",
        "span",
        "started_at",
        "stream",
        "text_chars",
        "text_open",
        "traceparent",
    )

    def __init__(
        self,
        tracker: RequestTracker,
        params: SpeechParams,
        link: ClientLink,
        started_at: float,
        text_open: bool,
    ) -> None:
        self._tracker = tracker
        self.params = params
        self.link = link
        """The connection the request's audio goes out on (it owns every write)."""
        self.api = link.api
        self.text_open = text_open
        self.started_at = started_at
        self.first_byte_at: float | None = None
        self.bytes_sent = 0
        """The request's audio bytes written to the client (its log line's)."""
        self.completed = False
        """Set by ``complete`` once the client has everything (the outcome is then ok)."""
        self.text_chars = len(params.text)
        self.stream: PcmStream  # set by RequestTracker.admit
        self.runs: Runs | None = None
        """Its text cut at break tags, spoken run by run (``gateway.text.pauses``); None: one run."""
        self.traceparent: str | None = None
        """The client's W3C trace context, continued when tracing is on."""
        self.cache_use: CacheUse = USE
        """What the request lets the sentence audio cache do (``gateway.cache.control``)."""
        self.flight_leader: PcmStream | None = None
        """A follower's leader: the twin whose synthesis it hears (single flight)."""
        self.cache_tenant: str | None = None
        """Whose entries the request reads and writes; None: its link's API key."""
        self.cache_state: str | None = None
        """``hit`` (served from the cache, no engine slot), ``partial`` (its first sentences
        from the cache, the rest synthesised), ``miss`` (synthesised), or None: the cache is
        off or the text cannot be cached (open text, break tags)."""
        self.cache_key: UnitKey | None = None
        """The unit's key, when its audio is to be stored once it has been synthesised."""
        self.cache_prefix: bytes | None = None
        """``partial``: the PCM of the text's first sentences, from the cache."""
        self.cache_rest: str | None = None
        """``partial``: the text after them, the one worker stream synthesised."""
        self.span: Span | None = None
        """The request's ``tts.request`` span (tracing on), from admission to finish."""

    async def __aenter__(self) -> ActiveRequest:
        await self._tracker.admit(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._tracker.finish(self, e)

    @property
    def audio_seconds(self) -> float:
        return self.stream.bytes_received / BYTES_PER_SECOND

    # -- what the link tells it ------------------------------------------------------------
    def audio_written(self, n: int) -> None:
        """``n`` bytes of this request's audio reached the client (``ClientLink.write``)."""
        if self.first_byte_at is None:
            self.first_audio(self._tracker.loop.time())
        self.bytes_sent += n

    def first_audio(self, now: float) -> None:
        """The request's first audio reached the client at loop time ``now``: its time to
        first audio. The one place that moment is known, whichever front end wrote it."""
        self.first_byte_at = now
        self._tracker.metrics.ttfb_by_api[self.api].observe(now - self.started_at)
        if self.span is not None and self.span.is_recording():  # audio held past the end: ended
            self.span.add_event("first_audio_byte")

    def complete(self) -> None:
        """The client has everything: the request ends ``ok``."""
        self.completed = True

    # -- the request's stream ------------------------------------------------------------------
    def append_text(self, text: str, *, final: bool, chars: int | None = None) -> None:
        """More text for a request opened with ``text_open`` (ZeroMQ). ``chars``: the
        client's characters this append brought (default ``len(text)``); a front end that
        holds text back or rewrites it counts what the client sent, when it arrived."""
        self._tracker.append_text(self, text, final=final, chars=chars)

    def fail(self, error: StreamError) -> None:
        """Fail the request's stream (cancelled upstream); its front end learns it from
        ``next_chunks``."""
        self._tracker.registry.fail(self.stream, error, discard_pending=True)

    def drop(self, why: str) -> None:
        """Drop a client that stopped reading: fail the stream and tear down the connection
        (its link's ``drop``)."""
        self._tracker.registry.drop_slow_client(self.stream, why)


def open_text_too_long(total: int, limit: int) -> APIError:
    """The error of an open text (ZeroMQ ``text_open``) whose characters, counted as the
    client sent them, would pass ``gateway.max_input_chars``."""
    return APIError(
        400,
        "input_too_long",
        f"the stream's text would reach {total} characters; the limit is {limit}",
        param="text",
    )


class RequestTracker:
    """Admits, tracks and finishes every request of one gateway process."""

    def __init__(
        self,
        config: GatewayConfig,
        admission: Admission,
        registry: StreamRegistry,
        upstream: Upstream,
        metrics: GatewayMetrics,
        tracing: Tracing | None = None,
        cache: AudioCache | None = None,
    ) -> None:
        self.config = config
        self.cache = cache
        """The sentence audio cache (``gateway.cache``); None: off."""
        self._flights: dict[str, PcmStream] = {}
        """Key digest -> the stream synthesising that unit now (a single flight's leader), in
        this process or, through a proxy, in another of the node's (``_tails``)."""
        self._tails: dict[str, FlightTail] = {}
        """Key digest -> the flight of another gateway process that this one's twins follow
        (``gateway.cache.relay``): its proxy stream is their leader in ``_flights``."""
        self.tracing = tracing
        self.incoming_traceparent = INCOMING_TRACEPARENT
        """Set by the app's tracing middleware: the HTTP request's ``traceparent`` header."""
        self.admission = admission
        self.registry = registry
        self.upstream = upstream
        self.metrics = metrics
        self.active: set[ActiveRequest] = set()
        self._engine_active = metrics.engine_gauges(upstream.engines)
        self.loop: asyncio.AbstractEventLoop  # set by ``start``

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def __len__(self) -> int:
        return len(self.active)

    def close(self) -> None:
        """Stop following the flights of the node's other gateway processes (their
        followers here fail: the gateway stops)."""
        for tail in list(self._tails.values()):
            tail.stream.fail(
                StreamError("shutdown", "the gateway stopped", 503), discard_pending=False
            )
            tail.stop()

    def open(
        self,
        params: SpeechParams,
        link: ClientLink,
        *,
        text_open: bool = False,
        started_at: float | None = None,
        traceparent: str | None = None,
        text_chars: int | None = None,
        cache: CacheUse = USE,
        cache_tenant: str | None = None,
    ) -> ActiveRequest:
        """A request for ``params`` whose audio goes out on ``link`` (its ``api`` labels the
        request), to enter with ``async with`` (admitted on entry). ``traceparent``: the
        client's W3C trace context (default: the HTTP request's header,
        ``INCOMING_TRACEPARENT``); used only when tracing is on. ``text_chars``: the
        client's characters ``params.text`` stands for, when the front end rewrote or held
        back some of it (ZeroMQ's open text; default ``len(params.text)``). ``cache``: what
        the request lets the sentence audio cache do (its ``Cache-Control``, its protocol's
        field); ``cache_tenant``: whose entries it uses, when not its link's key (a job's
        owner: ``gateway.cache.keys.job_tenant``)."""
        t0 = self.loop.time() if started_at is None else started_at
        request = ActiveRequest(self, params, link, t0, text_open)
        request.cache_use = cache
        request.cache_tenant = cache_tenant
        if text_chars is not None:  # the client's characters, before the front end's rewriting
            request.text_chars = text_chars
        if self.tracing is not None:
            request.traceparent = INCOMING_TRACEPARENT.get() if traceparent is None else traceparent
        return request

    def _trace_request(self, request: ActiveRequest) -> int:
        """Start the request's span (backdated to ``started_at``); returns the wall-clock ns
        at which admission is asked."""
        assert self.tracing is not None
        now_ns = time.time_ns()
        params = request.params
        request.span = self.tracing.start(
            "tts.request",
            request.traceparent,
            attributes={
                "orpheus.api": str(request.api), "orpheus.voice": params.voice,
                "orpheus.text_chars": request.text_chars,
                "orpheus.response_format": params.response_format,
            },
            start_ns=now_ns - int((self.loop.time() - request.started_at) * 1e9),
            server=True,
        )  # fmt: skip
        return now_ns

    def _trace_admitted(
        self,
        request: ActiveRequest,
        asked_ns: int,
        engine: int | None,
        outcome: str = "ok",
        message: str = "",
    ) -> None:
        """The queue wait: an attribute of the request's span, and a ``gateway.admission``
        span of its own when it took ``QUEUED_SPAN_NS`` or more, or was refused."""
        assert self.tracing is not None and request.span is not None
        now_ns = time.time_ns()
        request.span.set_attribute("orpheus.queue_wait_s", round((now_ns - asked_ns) / 1e9, 6))
        if now_ns - asked_ns < QUEUED_SPAN_NS and outcome == "ok":
            return
        span = self.tracing.start("gateway.admission", parent=request.span, start_ns=asked_ns)
        if engine is not None:
            span.set_attribute("orpheus.engine", engine)
        self._end_span(span, outcome, message)

    async def admit(self, request: ActiveRequest) -> None:
        asked_ns = 0 if self.tracing is None else self._trace_request(request)
        if self.cache is not None and (found := await self._look_up(request)) is not None:
            if isinstance(found, PcmStream):  # a twin being synthesised: follow it
                self._admit_hit(request, b"", asked_ns, leader=found)
            else:
                self._admit_hit(request, found, asked_ns)
            return
        with self.metrics.queued.track_inprogress():
            try:
                link = request.link
                engine = await self.admission.acquire(
                    link.key, continuing=link.continues(self.loop.time())
                )
            except BaseException as e:
                if isinstance(e, APIError):
                    self.metrics.count_request(request.api, "rejected")
                if asked_ns:
                    why = "rejected" if isinstance(e, APIError) else "cancelled"
                    self._trace_admitted(request, asked_ns, None, why, str(e))
                    self._end_span(request.span, why, str(e))
                raise
        traceparent = ""
        if asked_ns:
            assert self.tracing is not None and request.span is not None
            self._trace_admitted(request, asked_ns, engine)
            traceparent = self.tracing.traceparent(request.span)
        params = request.params
        stream = self.registry.open(
            self.loop.time(), text_closed=not request.text_open, engine=engine
        )
        text, text_open, runs = params.text, request.text_open, None
        if request.cache_prefix is not None and request.cache_rest is not None:
            # Its first sentences from the cache, before the rest's audio; the rest is
            # submitted now, not once they have been sent (no gap at the seam).
            self._push_cached(stream, request.cache_prefix)
            text = request.cache_rest
        if text_open or has_breaks(text):
            # Break tags (checked by build_params, or by the front end for open text): one
            # worker stream per run of text, the pauses' silence pushed between them
            # (gateway.text.pauses). Open text may bring tags in any append.
            runs = Runs(split_breaks(text, None), open_text=text_open, traceparent=traceparent)
            text, text_open = runs.next_run(self._silence(stream)) or ("", text_open)
        try:
            if not stream.done:  # (a pause's silence past the buffer's limit failed it)
                self.upstream.submit(
                    stream, params, text, text_open=text_open, traceparent=traceparent
                )
        except UpstreamUnavailable as e:
            self.registry.fail(
                stream, StreamError("upstream_unavailable", str(e), 503), discard_pending=True
            )
            self.admission.release(engine, request.link.key)
            self.metrics.count_request(request.api, "upstream_error")
            self._end_span(request.span, "upstream_error", str(e))
            raise APIError(
                503, "upstream_unavailable", str(e), retry_after_s=self.config.retry_after_s
            ) from None
        stream.on_abort = request.link.abort
        request.link.units_open += 1
        if request.cache_key is not None:
            stream.record = []
            if request.cache_state == "miss" and request.cache_use.read:
                self._lead(stream, request.cache_key)
        if runs is not None:
            request.runs = runs
            stream.on_end = lambda end: self._next_run(request, runs, end)
        request.stream = stream
        if request.span is not None:
            request.span.set_attribute("orpheus.stream_id", f"{stream.stream_id:#x}")
        self.active.add(request)
        self.metrics.active.inc()
        self._engine_active[engine].inc()

    # -- the sentence audio cache --------------------------------------------------------------
    async def _look_up(self, request: ActiveRequest) -> bytes | PcmStream | None:
        """The unit's cached PCM if the request may read it and the cache has it, or the
        stream of a twin being synthesised on the node (a single flight's leader, to follow:
        in this process, or a proxy of another's); else sets what the request's synthesis
        is to store (``cache_key``)."""
        cache = self.cache
        assert cache is not None
        params = request.params
        if request.text_open or has_breaks(params.text) or not params.text.strip():
            return None  # not one unit (open text, pauses): never cached
        tenant = request.link.key if request.cache_tenant is None else request.cache_tenant
        voice, sampling = params.voice, params.sampling
        key = cache.key(tenant, params.text, voice, sampling)
        request.cache_state = "miss"
        use = request.cache_use
        if not use.read:
            cache.count("bypass")
            request.cache_key = key if use.write else None
            return None
        pcm = await cache.lookup(key)
        if pcm is not None:
            cache.count("hit")
            return pcm
        digest = key.digest()
        leader = self._flights.get(digest)
        if leader is None and (joined := await cache.follow(key)) is not None:
            leader = self._proxy(digest, joined)  # led by another gateway process
        if leader is not None and leader.error is None and leader.record is not None:
            cache.count("join")
            return leader
        # Several sentences (an HTTP text): the longest run of cached ones from its start
        # plays at once, the rest is one worker stream. Not with ``max_tokens``, the length
        # of the whole text.
        parts = sentences(params.text) if sampling.max_tokens is None else []
        found: list[bytes] = []
        if len(parts) > 1:
            for sentence in parts[:MAX_SENTENCE_LOOKUPS]:
                if (p := await cache.lookup(cache.key(tenant, sentence, voice, sampling))) is None:
                    break
                found.append(p)
        if found and len(found) == len(parts):
            cache.count("hit")
            return b"".join(found)
        if found:
            request.cache_state = "partial"
            request.cache_prefix = b"".join(found)
            request.cache_rest = " ".join(parts[len(found) :])
            key = cache.key(tenant, request.cache_rest, voice, sampling)
        cache.count(request.cache_state)
        request.cache_key = key if use.write else None
        return None

    def _admit_hit(
        self, request: ActiveRequest, pcm: bytes, asked_ns: int, leader: PcmStream | None = None
    ) -> None:
        """Serve ``request`` from the cache: no engine slot (the key's concurrency counts
        it: ``Admission.hold_key``), no worker stream; its audio is all there at once. With
        ``leader``: a follower of that twin's synthesis (its audio so far at once, the rest
        as it is made, its end)."""
        link = request.link
        try:
            self.admission.hold_key(link.key)
        except APIError as e:
            self.metrics.count_request(request.api, "rejected")
            if asked_ns:
                self._trace_admitted(request, asked_ns, None, "rejected", str(e))
                self._end_span(request.span, "rejected", str(e))
            raise
        if asked_ns:
            self._trace_admitted(request, asked_ns, None)
        request.cache_state = "hit"
        now = self.loop.time()
        stream = PcmStream(0, now)
        stream.first_audio_at = now
        if leader is None:
            self._push_cached(stream, pcm)
            stream.finish(StreamEnd("stop", len(pcm) // PCM_FRAME_BYTES))
        else:
            self._follow(request, stream, leader)
        stream.on_abort = link.abort
        link.units_open += 1
        request.stream = stream
        self.active.add(request)
        self.metrics.active.inc()

    # -- single flight: concurrent twins synthesise once ----------------------------------------
    def _lead(self, stream: PcmStream, key: UnitKey) -> None:
        """``stream`` synthesises the unit ``key`` (a miss): the twins that ask for it while
        it is made follow it, in this process (``_follow``) and in the node's others (its
        log: ``AudioCache.lead``)."""
        digest = key.digest()
        if digest not in self._flights:
            self._flights[digest] = stream
            stream.flight = digest
            stream.followers = []
            if self.cache is not None:
                stream.relay = self.cache.lead(key)

    def _proxy(self, digest: str, joined: Joined) -> PcmStream:
        """The proxy stream of a flight another gateway process leads (``joined``): fed from
        its log, this process's twins follow it. One per unit: a leader that appeared here
        meanwhile is followed instead."""
        if (leader := self._flights.get(digest)) is not None:
            joined.reader.close()
            return leader
        proxy = PcmStream(0, self.loop.time())
        proxy.flight = digest
        self._tails[digest] = FlightTail(joined, proxy, self._tail_ended)
        self._flights[digest] = proxy
        return proxy

    def _tail_ended(self, tail: FlightTail) -> None:
        digest = tail.stream.flight
        if digest is not None and self._tails.get(digest) is tail:
            del self._tails[digest]
            if self._flights.get(digest) is tail.stream:
                del self._flights[digest]

    def _follow(self, request: ActiveRequest, stream: PcmStream, leader: PcmStream) -> None:
        record = leader.record or []
        for chunk in record:
            stream.push(chunk)
        if leader.end is not None:
            stream.finish(leader.end)  # it ended: all its audio was in its record
            return
        assert leader.followers is not None
        leader.followers.append(stream)
        request.flight_leader = leader

    def _end_flight(self, request: ActiveRequest) -> bool:
        """A leader's request is leaving: no twin of this process joins it any more. True
        when its worker stream goes on for its followers (its client left first): it is
        orphaned, and its slot is released when it ends (``_orphan_done``). With no
        follower here, it goes on until its log says whether one of the node's other
        processes listens (``_unheard``)."""
        stream = request.stream
        if stream.flight is not None and self._flights.get(stream.flight) is stream:
            del self._flights[stream.flight]
        if stream.done or (not stream.followers and stream.relay is None):
            return False
        stream.orphan()
        stream.on_done = lambda: self._orphan_done(request)
        if not stream.followers:
            self._unheard(stream, "client_disconnected")
        return True

    def _orphan_done(self, request: ActiveRequest) -> None:
        """An orphaned leader's worker stream ended or failed: store it if whole, free its
        slot."""
        stream = request.stream
        if stream.ended:
            self._store(request)
        self._engine_active[stream.engine].dec()
        self.admission.release(stream.engine, request.link.key)

    def _leave_flight(self, request: ActiveRequest) -> None:
        """A follower is leaving; the last follower of an orphaned leader cancels it (unless
        the node's other processes listen), the last of a proxy stops its tail."""
        leader, request.flight_leader = request.flight_leader, None
        if leader is None:
            return
        if leader.followers and request.stream in leader.followers:
            leader.followers.remove(request.stream)
        if leader.followers or leader.done:
            return
        tail = self._tails.get(leader.flight) if leader.flight is not None else None
        if tail is not None and tail.stream is leader:
            tail.stop()  # its join lock goes: the leader may cancel
        elif leader.orphaned:
            self._unheard(leader, "cancelled")

    def _unheard(self, leader: PcmStream, reason: str) -> None:
        """An orphaned leader has no follower left in this process: cancelled, unless a
        follower in another of the node's processes listens (asked of its log; then it goes
        on to its end, stored if whole)."""
        relay = leader.relay
        if relay is None:
            self._cancel_orphan(leader, reason)
            return

        def answered(listens: bool) -> None:
            if not listens:
                self._cancel_orphan(leader, reason)

        relay.listened(answered)

    def _cancel_orphan(self, leader: PcmStream, reason: str) -> None:
        """Cancel an orphaned leader nobody listens to (``reason``: its worker stream's)."""
        if leader.orphaned and not leader.followers and not leader.done and not leader.ending:
            self.registry.release(leader, reason)  # its worker stream is cancelled
            leader.fail(
                StreamError("cancelled", "nobody listens any more", 499), discard_pending=True
            )

    @staticmethod
    def _push_cached(stream: PcmStream, pcm: bytes) -> None:
        """Cached ``pcm`` into ``stream``, in ``HIT_CHUNK_BYTES`` pieces (``cached_bytes``:
        the learned capacity measures the workers' audio only)."""
        for i in range(0, len(pcm), HIT_CHUNK_BYTES):
            stream.push(pcm[i : i + HIT_CHUNK_BYTES])
        stream.cached_bytes += len(pcm)

    def _store(self, request: ActiveRequest) -> None:
        """A miss whose unit was synthesised whole and delivered: its audio to the cache."""
        stream = request.stream
        end = stream.end
        if (
            self.cache is not None
            and request.cache_key is not None
            and stream.record
            and stream.ended
            and end is not None
            and end.reason in STORED_ENDS
        ):
            self.cache.store(
                request.cache_key, b"".join(stream.record), force=not request.cache_use.read
            )
        stream.record = None

    def _silence(self, stream: PcmStream) -> Silence:
        return lambda ms: self.registry.push_silence(stream, ms)

    def _next_run(self, request: ActiveRequest, runs: Runs, end: StreamEnd) -> StreamEnd | None:
        """A run of ``request``'s text ended (``end``): push the silence of the pauses after
        it and start the next run (None: the stream goes on); else the request's END."""
        runs.add(end)
        runs.in_workers = False
        if end.reason == "cancelled":
            return runs.end()
        return self._start_run(request, runs)

    def _start_run(self, request: ActiveRequest, runs: Runs) -> StreamEnd | None:
        """Start ``request``'s next run under a new stream id, on the same engine and in the
        same admission slot, after the silence of the pauses before it. None: started, or
        waiting for words (open text); else the request's END (nothing is left to say)."""
        stream = request.stream
        run = runs.next_run(self._silence(stream))
        if run is None:
            return runs.end()
        text, text_open = run
        if stream.done or (text_open and not text.strip()):
            return None  # failed (a pause's silence left unread), or no words to speak yet
        self.registry.reopen(stream)
        stream.last_record_at = self.loop.time()
        runs.in_workers = True
        try:
            self.upstream.submit(
                stream, request.params, text, text_open=text_open, traceparent=runs.traceparent
            )
        except UpstreamUnavailable as e:
            self.registry.fail(
                stream, StreamError("upstream_unavailable", str(e), 503), discard_pending=False
            )
        return None

    def finish(self, request: ActiveRequest, exc: BaseException | None) -> None:
        stream = request.stream
        outcome = request_outcome(request, exc)
        hit = request.cache_state == "hit"
        orphaned = False
        if hit:
            self._leave_flight(request)
        elif stream.flight is not None:
            orphaned = self._end_flight(request)
        if outcome == "ok" and not hit:
            self._store(request)
        if not orphaned:
            self.registry.release(
                stream, "client_disconnected" if outcome in ("cancelled", "ok") else outcome
            )
        elapsed = self.loop.time() - request.started_at
        audio_s = request.audio_seconds
        rtf = elapsed / audio_s if audio_s else None
        if outcome == "ok" and rtf is not None:
            self.metrics.rtf_by_api[request.api].observe(rtf)
        self.metrics.count_request(request.api, outcome)
        ttfb = request.first_byte_at - request.started_at if request.first_byte_at else None
        # One line per stream at its end (JSON lines carry the fields as keys).
        fields = {
            "stream_id": f"{stream.stream_id:#x}", "api": str(request.api), "outcome": outcome,
            "engine": None if hit else stream.engine, "cache": request.cache_state,
            "ttfb_s": None if ttfb is None else round(ttfb, 4),
            "rtf": None if rtf is None else round(rtf, 4), "audio_s": round(audio_s, 3),
            "bytes_sent": request.bytes_sent, "text_chars": request.text_chars,
        }  # fmt: skip
        stream_log.info(
            "stream %s %s: ttfb %s s, rtf %s, audio %.2f s", fields["stream_id"], outcome,
            fields["ttfb_s"], fields["rtf"], audio_s, extra={"fields": fields},
        )  # fmt: skip
        if request.span is not None:
            request.span.set_attributes(
                {f"orpheus.{k}": fields[k] for k in _SPAN_FIELDS if fields[k] is not None}
            )
            self._end_span(request.span, outcome, stream.error.message if stream.error else "")
        self.active.discard(request)
        self.metrics.active.dec()
        link = request.link
        link.units_open -= 1
        link.unit_ended_at = self.loop.time()
        if hit:
            self.admission.release_key(link.key)
            return
        if orphaned:
            return  # its slot is its followers' until its worker stream ends
        self._engine_active[stream.engine].dec()
        self.admission.release(stream.engine, link.key)

    @staticmethod
    def _end_span(span: Span | None, outcome: str, message: str = "") -> None:
        """End ``span`` with the request's outcome (an error status unless ok or cancelled)."""
        if span is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("orpheus.outcome", outcome)
        if outcome not in ("ok", "cancelled"):
            span.set_status(Status(StatusCode.ERROR, message or outcome))
        span.end()

    def append_text(
        self, request: ActiveRequest, text: str, *, final: bool, chars: int | None = None
    ) -> None:
        stream = request.stream
        if stream.text_closed:
            raise APIError(400, "text_closed", "this stream's text is already complete")
        limit = self.config.max_input_chars
        total = request.text_chars + (len(text) if chars is None else chars)
        if total > limit:
            raise open_text_too_long(total, limit)
        check_text(text, None, param="text", allow_empty=True)
        request.text_chars = total
        if stream.done:
            return  # ended or failed meanwhile: the front end learns it from next_chunks
        stream.last_record_at = self.loop.time()  # the open text's idle clock too
        if not text and not final:
            return  # all of it held back by the front end (normalisation, dictionaries)
        upstream = self.upstream
        try:
            if request.runs is None:
                upstream.append_text(stream, text, final=final)
            else:  # break tags end the run in the workers (gateway.text.pauses)
                pieces = split_breaks(text, None) if has_breaks(text) else [text]
                runs = request.runs
                for piece, last in runs.append(pieces, final, self._silence(stream)):
                    upstream.append_text(stream, piece, final=last)
                if not runs.in_workers and (end := self._start_run(request, runs)) is not None:
                    stream.finish(end)  # the text ended after a pause: nothing more to say
        except UpstreamUnavailable as e:
            raise APIError(503, "upstream_unavailable", str(e)) from None
        if final:
            stream.text_closed = True

    def sweep(
        self,
        now: float,
        *,
        idle_s: float,
        text_idle_s: float,
        upstream_timeout: StreamError,
        text_timeout: StreamError,
    ) -> None:
        """The watchdog's pass: fail streams the workers or the client left idle (clients that
        accept no data are the links' to drop: ``ClientLinks.sweep``)."""
        for request in list(self.active):
            stream = request.stream
            if not stream.done:
                # Complete text: the workers went silent. Open text (ZeroMQ text_open):
                # the client neither finishes it nor adds to it, and it holds a slot.
                idle = now - stream.last_record_at
                if stream.text_closed and idle > idle_s:
                    self.registry.fail(stream, upstream_timeout, discard_pending=True)
                elif not stream.text_closed and idle > text_idle_s:
                    self.registry.fail(stream, text_timeout, discard_pending=True)
