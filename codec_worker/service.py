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
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Protocol

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
from common.codec_config import CodecConfig
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
)

log = logging.getLogger(__name__)

DEAD_TTL_S = 600.0
"""How long ids of failed streams are remembered if the llm_worker never ends them."""


class InputRecord(Protocol):
    kind: int
    stream_id: int
    seq: int
    payload: memoryview


class CodecService:
    def __init__(
        self,
        cfg: CodecConfig,
        engine: DecodeEngine,
        sink: RecordSink,
        gateways: int,
        clock: Callable[[], float] = time.monotonic,
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
            self.streams[sid] = s
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
            del self.streams[sid]
            self._put_end(s.gateway, sid, s.chunks, end, s.written)
        elif seq != s.received:
            self._fail(s, "sequence_gap", f"END at frame {seq}, received {s.received}")
        else:
            s.end = end
            if not s.in_flight and s.written == s.received:
                self._finish(s)

    def _on_error(self, sid: int, payload: memoryview) -> None:
        s = self.streams.pop(sid, None)
        if s is None and self._dead.pop(sid, None) is not None:
            return
        gateway = s.gateway if s is not None else gateway_of(sid)
        if gateway < self.gateways:
            self.sink.put(gateway, RecordKind.ERROR, sid, s.chunks if s else 0, payload)
        metrics.STREAMS_FAILED.labels("upstream").inc()

    def _on_reset(self, source: int) -> None:
        lost = [s for s in self.streams.values() if s.source == source]
        for s in lost:
            self._fail(s, "worker_restarted", "the stream's llm worker died; retry it", status=503)
        if lost:
            log.warning("code ring %d restarted: failed %d streams it left", source, len(lost))

    # -- stream endings --------------------------------------------------------------------------
    def _put_end(self, gateway: int, sid: int, chunks: int, end: StreamEnd, frames: int) -> None:
        out = StreamEnd(end.reason, frames, end.tokens, end.invalid_tokens_prevented)
        if gateway < self.gateways:
            self.sink.put(gateway, RecordKind.END, sid, chunks, record_encoder.encode(out))
        metrics.STREAMS_FINISHED.labels(end.reason).inc()

    def _finish(self, s: StreamState) -> None:
        assert s.end is not None
        del self.streams[s.stream_id]
        self._put_end(s.gateway, s.stream_id, s.chunks, s.end, s.written)

    def _error_record(self, code: str, message: str, status: int) -> bytes:
        return record_encoder.encode(StreamError(code=code, message=message, status=status))

    def _fail(self, s: StreamState, code: str, message: str, status: int = 500) -> None:
        log.warning("stream %#x failed in the codec worker: %s: %s", s.stream_id, code, message)
        self.streams.pop(s.stream_id, None)
        self._dead[s.stream_id] = self.clock()
        self.sink.put(
            s.gateway,
            RecordKind.ERROR,
            s.stream_id,
            s.chunks,
            self._error_record(code, message, status),
        )
        metrics.STREAMS_FAILED.labels(code).inc()

    def _fail_unknown(self, sid: int, code: str, message: str) -> None:
        log.warning("stream %#x failed in the codec worker: %s: %s", sid, code, message)
        self._dead[sid] = self.clock()
        self.sink.put(
            gateway_of(sid), RecordKind.ERROR, sid, 0, self._error_record(code, message, 500)
        )
        metrics.STREAMS_FAILED.labels(code).inc()

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
                        w.state.window_codes(w.start, w.start + key.frames), w.state.seed, w.start
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
