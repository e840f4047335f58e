"""Per-stream PCM buffers, and the registry that routes ring records into them.

One task (``gateway.pcm_pump``) drains the gateway's PCM ring and hands every batch of
records to ``StreamRegistry.dispatch``, which copies each payload out of the ring into the
bounded buffer of its stream and wakes the stream's consumer (an HTTP response, a
WebSocket, a ZeroMQ client). Nothing here blocks or awaits: a slow consumer only grows its
own buffer, up to a limit past which that stream alone is dropped.

A stream leaves the registry when it ends (``END``), fails (``ERROR``, a sequence gap, a
slow client, a timeout, a worker restart) or its consumer lets go; the registry tells its
``on_leave`` which, and why when it left before its worker stream ended (the one owner of
the worker stream, ``gateway.upstream``, cancels it then: the registry sends nothing).
Records that arrive for a stream id the registry does not hold are dropped and counted
(they belong to a stream that was cancelled or failed a moment ago).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Protocol

import msgspec

from gateway.metrics import GatewayMetrics
from shm.messages import UNDECODABLE
from shm.records import (
    BYTES_PER_SAMPLE,
    SAMPLE_RATE,
    STREAM_COUNTER_MASK,
    RecordKind,
    StreamEnd,
    StreamError,
    end_decoder,
    error_decoder,
    make_stream_id,
)
from shm.ring import Record

log = logging.getLogger(__name__)

_PCM = int(RecordKind.PCM)
_END = int(RecordKind.END)
_ERROR = int(RecordKind.ERROR)


BYTES_PER_MS = SAMPLE_RATE * BYTES_PER_SAMPLE // 1000
BYTES_PER_S = float(SAMPLE_RATE * BYTES_PER_SAMPLE)


def silence_pcm(ms: int) -> bytes:
    """``ms`` milliseconds of digital silence as the rings' PCM (a pause: ``<break>``)."""
    return bytes(ms * BYTES_PER_MS)


RETRYABLE_CODES = frozenset({"worker_restarted"})
"""Stream errors answered with ``Retry-After`` (``gateway.retry_after_s``): the same request
can succeed once the restarted worker is back."""


class StreamFailed(Exception):
    def __init__(self, error: StreamError) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


class Relay(Protocol):
    """What a single flight's leader tells beside its followers: the node's other gateway
    processes' (``gateway.cache.relay.FlightRelay``)."""

    def push(self, data: bytes) -> None: ...

    def done(
        self, terminal: StreamEnd | StreamError, then: Callable[[], None] | None = None
    ) -> None:
        """The stream ended or failed; ``then``: called (on the loop) once that is told."""

    def listened(self, then: Callable[[bool], None]) -> None:
        """Tell ``then`` (later, on the loop) whether anyone listens there."""


class PcmStream:
    """The PCM of one utterance between the ring and its consumer.

    The consumer calls ``next_chunks`` in a loop: it returns the chunks buffered since the
    last call (waiting if there are none), ``[]`` once the stream ended, and raises
    ``StreamFailed`` once it failed (after the audio that arrived before the failure, unless
    the failure discarded it). The list returned stays valid until the next call.
    """

    __slots__ = (
        "_pending",
        "_spare",
        "_waiter",
        "buffered_bytes",
        "bytes_received",
        "cached_bytes",
        "end",
        "ending",
        "engine",
        "error",
        "first_audio_at",
        "first_chunk_bytes",
        "flight",
        "followers",
        "last_record_at",
        "min_lead_s",
        "next_seq",
        "on_abort",
        "on_done",
        "on_end",
        "opened_at",
        "orphaned",
        "record",
        "relay",
        "stream_id",
        "text_closed",
    )

    def __init__(
        self, stream_id: int, now: float, *, text_closed: bool = True, engine: int = 0
    ) -> None:
        self.stream_id = stream_id
        self.engine = engine
        """The vLLM engine the stream was placed on: its every control message goes there."""
        self._pending: list[bytes] = []
        self.ending = False
        """Its end is being told to its relay: its consumer waits for it, its last chunks
        then its end as one stream's would come."""
        self._spare: list[bytes] = []
        self._waiter: asyncio.Future[None] | None = None
        self.buffered_bytes = 0
        self.bytes_received = 0
        self.cached_bytes = 0
        """Of ``bytes_received``, those from the sentence audio cache (a cached start)."""
        self.next_seq = 0
        self.end: StreamEnd | None = None
        self.error: StreamError | None = None
        self.last_record_at = now
        """Monotonic time of the last record or appended text: the idle watchdogs' clock."""
        self.opened_at = now
        self.first_audio_at: float | None = None
        """When its first PCM arrived (``gateway.admission.capacity`` measures from here)."""
        self.first_chunk_bytes = 0
        self.min_lead_s = math.inf
        """The least audio a player that started at the first chunk held, in seconds, just
        before a later chunk arrived (below 0: it ran dry; ``gateway.admission.capacity``)."""
        self.text_closed = text_closed
        self.on_abort: Callable[[], None] | None = None
        """Set by the front end: tears down the client connection (slow or stalled client)."""
        self.flight: str | None = None
        """A single flight's leader: the key digest of the unit it synthesises."""
        self.followers: list[PcmStream] | None = None
        """A single flight's leader (``gateway.requests``): the streams of the concurrent
        twins that hear its audio; each chunk pushed here is pushed to them, its end or
        failure is theirs."""
        self.relay: Relay | None = None
        """A single flight's leader for the node's other gateway processes: each chunk pushed
        here is told to it, then the end or failure."""
        self.orphaned = False
        """A leader whose own client left while followers listen: its worker stream goes on
        for them, and its own audio is no longer kept."""
        self.on_done: Callable[[], None] | None = None
        """Told once when the stream ends or fails (an orphaned leader's slot is released
        then)."""
        self.record: list[bytes] | None = None
        """Set for a unit the sentence audio cache may store (``gateway.requests``): every
        chunk pushed is kept here too (the same bytes objects), joined at the end."""
        self.on_end: Callable[[StreamEnd], StreamEnd | None] | None = None
        """Set for a request of several runs of text (break tags between them,
        ``gateway.requests``): told each worker stream's END; returns None when the stream
        goes on (the next run was started under a new id, ``StreamRegistry.reopen``), else
        the END the stream finishes with."""

    @property
    def done(self) -> bool:
        return self.end is not None or self.error is not None

    @property
    def ended(self) -> bool:
        """It ended with its END record (all its audio arrived), not a failure."""
        return self.end is not None and self.error is None

    # -- producer side (the dispatcher) ----------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def push(self, data: bytes) -> None:
        if not self.orphaned:
            self._pending.append(data)
            self.buffered_bytes += len(data)
        self.bytes_received += len(data)
        if self.record is not None:
            self.record.append(data)
        if self.followers:
            for f in self.followers:
                f.last_record_at = self.last_record_at
                f.push(data)
        if self.relay is not None:
            self.relay.push(data)
        self._wake()

    def finish(self, end: StreamEnd) -> None:
        if self.relay is not None:  # its end once told there: a twin after it never follows
            relay, self.relay = self.relay, None
            self.ending = True

            def told() -> None:
                self.ending = False
                if not self.done:
                    self.finish(end)
                self._wake()

            relay.done(end, told)
            return
        self.end = end
        self._done()
        self._wake()

    def fail(self, error: StreamError, *, discard_pending: bool) -> None:
        if self.done:
            return
        self.error = error
        if discard_pending:
            self._pending.clear()
            self.buffered_bytes = 0
        self._done()
        self._wake()

    def orphan(self) -> None:
        """A single flight's leader whose client left: keep nothing more for it."""
        self.orphaned = True
        self._pending.clear()
        self.buffered_bytes = 0

    def _done(self) -> None:
        """Its end or failure to its followers and its relay, then ``on_done``."""
        relay, self.relay = self.relay, None
        terminal = self.error if self.error is not None else self.end
        if relay is not None and terminal is not None:
            relay.done(terminal)
        followers, self.followers = self.followers, None
        for f in followers or ():
            if self.error is not None:
                f.fail(self.error, discard_pending=False)
            elif self.end is not None:
                f.finish(self.end)
        if self.on_done is not None:
            done, self.on_done = self.on_done, None
            done()

    # -- consumer side ---------------------------------------------------------------------
    async def next_chunks(self) -> list[bytes]:
        while True:
            if self._pending and not self.ending:
                out = self._pending
                spare = self._spare
                spare.clear()  # the list handed out by the previous call: its reader is done
                self._pending, self._spare = spare, out
                self.buffered_bytes = 0
                return out
            if self.error is not None:
                raise StreamFailed(self.error)
            if self.end is not None:
                self._spare.clear()
                return self._spare  # empty: the stream ended
            waiter = asyncio.get_running_loop().create_future()
            self._waiter = waiter
            try:
                await waiter
            finally:
                self._waiter = None


Leave = Callable[[PcmStream, str | None], None]
"""Told each stream that leaves the registry: None when its worker stream ended (its END or
ERROR came), else why it left before that (the workers may still produce it)."""


class StreamRegistry:
    """Stream ids of one gateway and the streams they name."""

    def __init__(
        self,
        gateway_index: int,
        on_leave: Leave,
        metrics: GatewayMetrics,
        *,
        max_buffered_bytes: int,
        retry_after_s: int | None = None,
    ) -> None:
        self._index = gateway_index
        self._on_leave = on_leave
        self._metrics = metrics
        self._max_buffered = max_buffered_bytes
        self._retry_after_s = retry_after_s
        self._streams: dict[int, PcmStream] = {}
        # Stream ids must stay unique across restarts of this gateway while the workers live
        # on (a stale record must never land in a new stream). The counter starts from the
        # wall clock in units of 1/64 ms: a restarted gateway starts past every id its
        # predecessor could have used unless that one opened more than 64 streams per ms.
        self._counter = (time.time_ns() // 1_000_000) << 6

    def __len__(self) -> int:
        return len(self._streams)

    def __contains__(self, stream: PcmStream) -> bool:
        return self._streams.get(stream.stream_id) is stream

    def streams(self) -> Iterable[PcmStream]:
        return self._streams.values()

    def open(self, now: float, *, text_closed: bool = True, engine: int = 0) -> PcmStream:
        self._counter += 1
        stream_id = make_stream_id(self._index, self._counter & STREAM_COUNTER_MASK)
        stream = PcmStream(stream_id, now, text_closed=text_closed, engine=engine)
        self._streams[stream_id] = stream
        return stream

    def reopen(self, stream: PcmStream) -> int:
        """Route the next worker stream of ``stream`` (a request's next run of text) to it:
        a new stream id, its sequence from 0. The old id left with its END; were it still
        routed, it leaves now (its worker stream cancelled)."""
        self._leave(stream, "cancelled")
        self._counter += 1
        stream.stream_id = make_stream_id(self._index, self._counter & STREAM_COUNTER_MASK)
        stream.next_seq = 0
        self._streams[stream.stream_id] = stream
        return stream.stream_id

    def push_silence(self, stream: PcmStream, ms: int) -> None:
        """``ms`` of a pause's silence into ``stream`` (``gateway.text.pauses``), within the same
        buffer limit as the ring's PCM: a client that leaves it unread is dropped."""
        n = ms * BYTES_PER_MS
        if stream.done or not n:
            return
        if stream.buffered_bytes + n > self._max_buffered:
            self.drop_slow_client(
                stream, f"client left more than {self._max_buffered} bytes unread"
            )
        else:
            stream.push(bytes(n))

    def _leave(self, stream: PcmStream, reason: str | None) -> None:
        """Stop routing ``stream``'s id, if it still is, and tell ``on_leave``."""
        if self._streams.get(stream.stream_id) is stream:
            del self._streams[stream.stream_id]
            self._on_leave(stream, reason)

    def release(self, stream: PcmStream, reason: str) -> None:
        """The consumer is done with ``stream``: it leaves (for ``reason``) unless it did."""
        self._leave(stream, reason)

    def fail(self, stream: PcmStream, error: StreamError, *, discard_pending: bool) -> None:
        """Fail ``stream``: it leaves, for ``error.code``."""
        self._fail(stream, error, discard_pending=discard_pending, reason=error.code)

    def _fail(
        self, stream: PcmStream, error: StreamError, *, discard_pending: bool, reason: str | None
    ) -> None:
        if error.code in RETRYABLE_CODES and error.retry_after_s is None:
            # Whichever process noticed the restart (the gateway, the codec worker, the llm
            # worker itself), the client hears when to retry, as for any other 503 here.
            error = msgspec.structs.replace(error, retry_after_s=self._retry_after_s)
        stream.fail(error, discard_pending=discard_pending)
        self._leave(stream, reason)

    def drop_slow_client(self, stream: PcmStream, why: str) -> None:
        """Fail ``stream`` because its client does not read, and tear the connection down."""
        self._metrics.slow_client_drops.inc()
        log.info("stream %#x: dropping slow client (%s)", stream.stream_id, why)
        error = StreamError("slow_client", why, 408)
        if stream.done:  # all its audio arrived, but the client does not take it
            stream.error = stream.error or error
        else:
            self.fail(stream, error, discard_pending=True)
        if stream.on_abort is not None:
            stream.on_abort()

    def fail_all(self, error: StreamError, *, engines: frozenset[int] | None = None) -> int:
        """Fail every stream (of ``engines`` only, when given)."""
        streams = [s for s in self._streams.values() if engines is None or s.engine in engines]
        for s in streams:
            self.fail(s, error, discard_pending=True)
        return len(streams)

    # -- the hot path ----------------------------------------------------------------------
    def dispatch(self, records: list[Record], now: float) -> None:
        """Route one poll's records to their streams. Never raises for a bad record."""
        streams = self._streams
        orphans = 0
        for kind, stream_id, seq, payload in records:
            stream = streams.get(stream_id)
            if stream is None:
                orphans += 1
                continue
            stream.last_record_at = now
            if kind == _PCM:
                if seq != stream.next_seq:
                    self._sequence_error(stream, seq)
                    continue
                stream.next_seq = seq + 1
                n = payload.nbytes
                if n & 1:
                    self._bad_record(stream, f"PCM record of odd length {n}")
                elif stream.buffered_bytes + n > self._max_buffered:
                    self.drop_slow_client(
                        stream, f"client left more than {self._max_buffered} bytes unread"
                    )
                elif n:
                    first = stream.first_audio_at
                    if first is None:  # (a pause's silence may have come before it)
                        stream.first_audio_at = now
                        stream.first_chunk_bytes = n
                    elif (
                        lead := (stream.bytes_received - stream.cached_bytes) / BYTES_PER_S
                        - (now - first)
                    ) < stream.min_lead_s:
                        stream.min_lead_s = lead
                    stream.push(bytes(payload))
            elif kind == _END:
                self._end(stream, payload, seq)
            elif kind == _ERROR:
                self._error(stream, payload)
            else:
                self._bad_record(stream, f"unexpected record kind {kind}")
        if orphans:
            self._metrics.orphan_records.inc(orphans)

    def _end(self, stream: PcmStream, payload: memoryview, seq: int) -> None:
        try:
            end = end_decoder.decode(payload)
        except UNDECODABLE as e:
            self._bad_record(stream, f"undecodable END record: {e}")
            return
        if seq != stream.next_seq:
            self._sequence_error(stream, seq, what="END")
            return
        del self._streams[stream.stream_id]
        self._on_leave(stream, None)
        if stream.on_end is not None:
            final = stream.on_end(end)
            if final is None:
                return  # the request's next run of text goes on in this stream
            end = final
        stream.finish(end)

    def _error(self, stream: PcmStream, payload: memoryview) -> None:
        try:
            err = error_decoder.decode(payload)
        except UNDECODABLE as e:
            err = StreamError("upstream_error", f"undecodable ERROR record: {e}", 502)
        self._fail(stream, err, discard_pending=False, reason=None)  # it ended the worker stream

    def _sequence_error(self, stream: PcmStream, seq: int, what: str = "PCM") -> None:
        self._metrics.sequence_errors.inc()
        msg = f"{what} record out of sequence: expected chunk {stream.next_seq}, got {seq}"
        log.error("stream %#x: %s", stream.stream_id, msg)
        self.fail(
            stream,
            StreamError("pcm_sequence_error", msg, 502),
            discard_pending=False,
        )

    def _bad_record(self, stream: PcmStream, msg: str) -> None:
        log.error("stream %#x: %s", stream.stream_id, msg)
        self.fail(stream, StreamError("bad_record", msg, 502), discard_pending=False)
