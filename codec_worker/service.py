"""The codec worker's core: code records in, PCM records out, independent of the transport.

``ingest`` takes the records of one ring poll (CODES, END, ERROR), ``pump`` completes the
batch in flight, writes its PCM and dispatches the next one. Per stream:

- CODES must continue the stream's frames exactly (``seq`` = frames received so far) and hold
  codes in [0, 4096); anything else fails the stream with an ERROR record, never the batch.
- END (stop/length/...) flushes the last frames, then forwards END with the frame count.
- END(cancelled) drops the stream's pending windows (and the output of one in flight) and
  forwards END(cancelled) with no more audio.
- ERROR is forwarded; the stream's state is dropped.
- RESET (a restarted llm worker's first record on its ring) fails every stream whose codes
  came from that ring: their worker died before it ended them.

Records come from one code ring per vLLM engine (``ingest``'s ``source``); stream ids are
unique across engines, so the streams of every engine share one decode batch.

After a stream failed, its later records are dropped until the llm_worker's END or ERROR for
it arrives. One stream's failure or stalled gateway never holds up the others.

Tracing (``common.tracing``, when on): a ``START`` record (written by the llm worker before a
traced stream's first CODES) opens the stream's ``codec.stream`` span, a child of the llm
worker's; its first CODES open ``codec.first_window``, ended when its first PCM is written;
every decode batch it takes part in is an event (``decode_batch``: frames, windows in the
batch, decode time) on ``codec.stream``, which ends with the stream. Untraced streams cost one
empty-dict test per record kind and batch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import msgspec
import numpy as np

from codec_worker import metrics
from codec_worker.decoder import WindowKey
from codec_worker.engine import DecodeEngine, DecodeRequest, PendingBatch
from codec_worker.levels import invalid_code_count
from codec_worker.noise import decode_seed
from codec_worker.output import RecordSink
from codec_worker.policy import StreamState, Window, WindowPolicy
from codec_worker.scheduler import Scheduler
from common.config.codec import CodecConfig
from shm.records import (
    CODE_DTYPE,
    FRAME_BYTES,
    FRAME_CODES,
    RecordKind,
    StreamEnd,
    StreamError,
    end_decoder,
    gateway_of,
    record_encoder,
    start_decoder,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from common.tracing import Tracing

log = logging.getLogger(__name__)

DEAD_TTL_S = 600.0
"""How long ids of failed streams are remembered if the llm_worker never ends them."""


class InputRecord(Protocol):
    kind: int
    stream_id: int
    seq: int
    payload: memoryview


@dataclass(slots=True)
class StreamTrace:
    """A traced stream's spans (tracing on)."""

    span: Span
    source: int
    """The code ring it came from (a RESET of that ring ends it)."""
    first: Span | None = None
    """``codec.first_window``: from the first CODES to the first PCM written."""


class CodecService:
    def __init__(
        self,
        cfg: CodecConfig,
        engine: DecodeEngine,
        sink: RecordSink,
        gateways: int,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.sink = sink
        self.gateways = gateways
        self.clock = clock
        self.policy = WindowPolicy(cfg)
        self.scheduler = Scheduler(cfg, self.policy)
        self.streams: dict[int, StreamState] = {}
        self._dead: dict[int, float] = {}
        self._inflight: tuple[PendingBatch, list[tuple[WindowKey, list[Window]]]] | None = None
        self._next_expiry = 0.0
        self.tracing = tracing
        self.traces: dict[int, StreamTrace] = {}
        """The traced streams' spans, by stream id (empty when tracing is off)."""
        self.batches = 0
        self.windows = 0
        """Batches and windows dispatched so far."""

    # -- input ---------------------------------------------------------------------------------
    def ingest(self, records: Iterable[InputRecord], source: int = 0) -> None:
        """Apply one poll's records from code ring ``source`` (payload views are read before
        this returns)."""
        now = self.clock()
        for r in records:
            if r.kind == RecordKind.CODES:
                self._on_codes(r.stream_id, r.seq, r.payload, now, source)
            elif r.kind == RecordKind.END:
                self._on_end(r.stream_id, r.seq, r.payload, now)
            elif r.kind == RecordKind.ERROR:
                self._on_error(r.stream_id, r.payload)
            elif r.kind == RecordKind.RESET:
                self._on_reset(source)
            elif r.kind == RecordKind.START:
                self._on_start(r.stream_id, r.payload, source)
            else:
                log.warning("ignoring a record of kind %d on the code ring", r.kind)

    def _on_codes(
        self, sid: int, seq: int, payload: memoryview, now: float, source: int = 0
    ) -> None:
        s = self.streams.get(sid)
        if s is None:
            if sid in self._dead:
                return
            gateway = gateway_of(sid)
            if gateway >= self.gateways:
                log.error("stream %#x names gateway %d of %d: dropped", sid, gateway, self.gateways)
                self._dead[sid] = now
                metrics.STREAMS_FAILED.labels("bad_gateway").inc()
                return
            if seq != 0:
                self._fail_unknown(sid, "sequence_gap", f"first codes record starts at frame {seq}")
                return
            s = StreamState(sid, gateway, decode_seed(self.cfg.noise_seed), now, source)
            if self.engine.watermark is not None:
                s.mark_slot = self.engine.watermark.acquire()
            self.streams[sid] = s
            if self.traces and (trace := self.traces.get(sid)) is not None:
                assert self.tracing is not None
                trace.first = self.tracing.start("codec.first_window", parent=trace.span)
        if s.end is not None:
            self._fail(s, "protocol", "codes after the stream's END")
        elif seq != s.received:
            self._fail(s, "sequence_gap", f"expected frame {s.received}, got {seq}")
        elif len(payload) % FRAME_BYTES:
            self._fail(s, "bad_codes", f"codes payload of {len(payload)} bytes is not whole frames")
        else:
            codes = np.frombuffer(payload, dtype=CODE_DTYPE).reshape(-1, FRAME_CODES)
            bad = invalid_code_count(codes)
            if bad:
                self._fail(s, "bad_codes", f"{bad} codes outside [0, 4096) from frame {seq}")
            else:
                s.append(codes, keep_from=s.scheduled - self.policy.history)

    def _on_start(self, sid: int, payload: memoryview, source: int) -> None:
        """A traced stream begins: continue its trace (ignored when tracing is off here)."""
        if self.tracing is None or sid in self.traces:
            return
        try:
            start = start_decoder.decode(payload)
        except msgspec.DecodeError:
            log.warning("stream %#x: undecodable START record ignored", sid)
            return
        attributes = {
            "orpheus.stream_id": f"{sid:#x}", "orpheus.voice": start.voice,
            "orpheus.gateway": gateway_of(sid),
        }  # fmt: skip
        span = self.tracing.start("codec.stream", start.traceparent, attributes=attributes)
        self.traces[sid] = StreamTrace(span, source)

    def _end_trace(self, sid: int, outcome: str, frames: int, message: str = "") -> None:
        trace = self.traces.pop(sid, None)
        if trace is None:
            return
        from opentelemetry.trace import Status, StatusCode

        if trace.first is not None:
            trace.first.end()
        trace.span.set_attributes({"orpheus.outcome": outcome, "orpheus.frames": frames})
        if message:
            trace.span.set_status(Status(StatusCode.ERROR, message))
        trace.span.end()

    def _on_end(self, sid: int, seq: int, payload: memoryview, now: float) -> None:
        s = self.streams.get(sid)
        if s is None and self._dead.pop(sid, None) is not None:
            return  # already failed and reported
        try:
            end = end_decoder.decode(payload)
        except msgspec.DecodeError:
            if s is not None:
                self._fail(s, "protocol", "undecodable END record")
            else:
                self._fail_unknown(sid, "protocol", "undecodable END record")
            return
        if s is None:
            if seq != 0 and end.reason != "cancelled":
                self._fail_unknown(sid, "sequence_gap", f"END after {seq} frames never received")
                return
            # A stream that produced no audio (or was cancelled before any).
            self._put_end(gateway_of(sid), sid, 0, end, 0)
            return
        if end.reason == "cancelled":
            self._forget(s)
            self._put_end(s.gateway, sid, s.chunks, end, s.written)
        elif seq != s.received:
            self._fail(s, "sequence_gap", f"END at frame {seq}, received {s.received}")
        else:
            s.end = end
            if not s.in_flight and s.written == s.received:
                self._finish(s)

    def _on_error(self, sid: int, payload: memoryview) -> None:
        s = self.streams.get(sid)
        if s is not None:
            self._forget(s)
        elif self._dead.pop(sid, None) is not None:
            return
        gateway = s.gateway if s is not None else gateway_of(sid)
        if gateway < self.gateways:
            self.sink.put(gateway, RecordKind.ERROR, sid, s.chunks if s else 0, payload)
        metrics.STREAMS_FAILED.labels("upstream").inc()
        if self.traces:
            self._end_trace(
                sid, "upstream_error", s.written if s else 0, "the llm worker failed it"
            )

    def _on_reset(self, source: int) -> None:
        lost = [s for s in self.streams.values() if s.source == source]
        for s in lost:
            self._fail(s, "worker_restarted", "the stream's llm worker died; retry it", status=503)
        if lost:
            log.warning("code ring %d restarted: failed %d streams it left", source, len(lost))
        for sid in [sid for sid, t in self.traces.items() if t.source == source]:
            self._end_trace(sid, "worker_restarted", 0, "the stream's llm worker died")

    # -- stream endings --------------------------------------------------------------------------
    def _forget(self, s: StreamState) -> None:
        """Drop a stream's state (its watermark slot too)."""
        if self.streams.pop(s.stream_id, None) is s and s.mark_slot:
            assert self.engine.watermark is not None
            self.engine.watermark.release(s.mark_slot)

    def _put_end(self, gateway: int, sid: int, chunks: int, end: StreamEnd, frames: int) -> None:
        out = StreamEnd(end.reason, frames, end.tokens, end.invalid_tokens_prevented)
        if gateway < self.gateways:
            self.sink.put(gateway, RecordKind.END, sid, chunks, record_encoder.encode(out))
        metrics.STREAMS_FINISHED.labels(end.reason).inc()
        if self.traces:
            self._end_trace(sid, end.reason, frames)

    def _finish(self, s: StreamState) -> None:
        assert s.end is not None
        self._forget(s)
        self._put_end(s.gateway, s.stream_id, s.chunks, s.end, s.written)

    def _error_record(self, code: str, message: str, status: int) -> bytes:
        return record_encoder.encode(StreamError(code=code, message=message, status=status))

    def _fail(self, s: StreamState, code: str, message: str, status: int = 500) -> None:
        log.warning("stream %#x failed in the codec worker: %s: %s", s.stream_id, code, message)
        self._forget(s)
        self._dead[s.stream_id] = self.clock()
        self.sink.put(
            s.gateway,
            RecordKind.ERROR,
            s.stream_id,
            s.chunks,
            self._error_record(code, message, status),
        )
        metrics.STREAMS_FAILED.labels(code).inc()
        if self.traces:
            self._end_trace(s.stream_id, code, s.written, message)

    def _fail_unknown(self, sid: int, code: str, message: str) -> None:
        log.warning("stream %#x failed in the codec worker: %s: %s", sid, code, message)
        self._dead[sid] = self.clock()
        self.sink.put(
            gateway_of(sid), RecordKind.ERROR, sid, 0, self._error_record(code, message, 500)
        )
        metrics.STREAMS_FAILED.labels(code).inc()
        if self.traces:
            self._end_trace(sid, code, 0, message)

    # -- batches ---------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """A batch is in flight (``pump`` will wait for it)."""
        return self._inflight is not None

    def pump(self) -> bool:
        """Finish the batch in flight, dispatch the next if one is due. True if it did work."""
        did = False
        if self._inflight is not None:
            self._complete()
            self._flush()
            did = True
        now = self.clock()
        windows = self.scheduler.select(self.streams.values(), now)
        if windows:
            self._dispatch(windows, now)
            did = True
        self._flush()
        if now >= self._next_expiry:
            self._expire_dead(now)
        if self.engine.heap is not None and self._inflight is None and not self.streams:
            self.engine.heap.when_idle()  # no stream left: a flood's memory goes back now
        metrics.ACTIVE_STREAMS.set(len(self.streams))
        return did

    def next_wakeup_s(self, now: float) -> float:
        """Seconds until ``pump`` may have work if no record arrives before (0: now)."""
        if self._inflight is not None:
            return 0.0
        return max(0.0, self.scheduler.wakeup_at - now)

    def _dispatch(self, windows: list[Window], now: float) -> None:
        groups: dict[WindowKey, list[Window]] = {}
        slack = math.inf
        for w in windows:
            s = w.state
            groups.setdefault(w.key, []).append(w)
            metrics.QUEUE_WAIT.observe(now - s.ready_since)
            metrics.WINDOW_HOP.observe(w.key.hop)
            if w.late:
                metrics.SHORT_LOOKAHEAD_WINDOWS.inc()
            if not math.isnan(s.play_start):
                slack = min(slack, w.deadline - now)
                if now > w.deadline > s.ready_since:
                    metrics.LATE_WINDOWS.inc()
            s.in_flight = True
            s.scheduled += w.key.hop
            s.ready_since = math.nan
        if slack < math.inf:
            metrics.DEADLINE_SLACK.set(slack)
        metrics.BATCH_WINDOWS.observe(len(windows))
        self.batches += 1
        self.windows += len(windows)
        requests = [
            (
                key,
                [
                    DecodeRequest(
                        w.state.window_codes(w.start, w.start + key.frames),
                        w.state.seed,
                        w.start,
                        w.state.mark_slot,
                    )
                    for w in ws
                ],
            )
            for key, ws in groups.items()
        ]
        self._inflight = (self.engine.submit(requests), list(groups.items()))

    def _complete(self) -> None:
        assert self._inflight is not None
        pending, groups = self._inflight
        self._inflight = None
        pcm = pending.wait()
        metrics.DECODE_TIME.observe(pending.decode_s)
        self.scheduler.observe_decode(pending.decode_s)
        now = self.clock()
        if self.traces:
            self._trace_batch(groups, pending.decode_s)
        for (key, windows), out in zip(groups, pcm, strict=True):
            for w, samples in zip(windows, out, strict=True):
                s = w.state
                s.in_flight = False
                if self.streams.get(s.stream_id) is not s:
                    continue  # cancelled or failed while in flight: its audio is dropped
                self.sink.put(s.gateway, RecordKind.PCM, s.stream_id, s.chunks, samples)
                s.chunks += 1
                s.written += key.hop
                if math.isnan(s.play_start):
                    s.play_start = now
                if s.end is not None and s.written == s.received:
                    self._finish(s)

    def _trace_batch(self, groups: list[tuple[WindowKey, list[Window]]], decode_s: float) -> None:
        """One ``decode_batch`` event per traced stream of the batch; ends first windows."""
        n = sum(len(ws) for _, ws in groups)
        for key, windows in groups:
            for w in windows:
                trace = self.traces.get(w.state.stream_id)
                if trace is None:
                    continue
                attributes = {
                    "orpheus.frames": key.hop, "orpheus.window_frames": key.frames,
                    "orpheus.batch_windows": n, "orpheus.decode_ms": round(decode_s * 1e3, 3),
                }  # fmt: skip
                trace.span.add_event("decode_batch", attributes)
                if trace.first is not None:
                    trace.first.set_attributes(attributes)
                    trace.first.end()  # its PCM is written just after (this _complete)
                    trace.first = None

    def _flush(self) -> None:
        for sid in self.sink.flush(self.clock()):
            s = self.streams.get(sid)
            message = "the gateway's PCM ring stayed full"
            if s is not None:
                self._fail(s, "backpressure", message, status=503)
            else:
                self._fail_unknown(sid, "backpressure", message)

    def _expire_dead(self, now: float) -> None:
        self._dead = {k: t for k, t in self._dead.items() if now - t < DEAD_TTL_S}
        self._next_expiry = now + 10.0

    def drain(self) -> None:
        """Complete the batch in flight and publish (used when stopping)."""
        if self._inflight is not None:
            self._complete()
        self._flush()
