"""A synthetic llm_worker + codec_worker for gateway tests and ``bench gateway``.

NOT part of the serving path. It speaks the real contracts on the real transports: it
binds the control PULL socket (``LlmSubmit``/``LlmAppendText``/``LlmCancel``), writes ``PCM``/``END``/
``ERROR`` records into the real PCM rings, and (standing in for the orchestrator) publishes
``ClusterStatus``. What it does with each request is a ``StreamPlan``: by default a
deterministic tone of ``max_tokens // 7`` frames (one frame = 2048 samples = 85.3 ms), and an
``ERROR`` of status 400 for a voice it does not know, as the llm_worker answers.

Pacing: ``realtime=True`` emits each stream's frames at the rate a real-time pipeline does
(one per 85.3 ms after ``first_chunk_delay_s``), batched per ``tick_s`` like the codec
worker's decode batches; otherwise as fast as the ring takes them. ``capacity=C`` (with
``realtime``) plays a node that holds C streams in real time: with n streams open each frame
takes ``85.3 ms * n / C`` (faster than real time below C, slower above), as a batched
engine's step time grows with its batch. With ``stamp=True`` the
first 8 bytes of each chunk carry ``time.monotonic_ns()`` at the moment it was written, so
a client can measure delivery lag (CLOCK_MONOTONIC is system-wide on Linux).
"""

from __future__ import annotations

import heapq
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import Literal

import msgspec
import numpy as np
import zmq

from gateway.voices.catalogue import ENGLISH_VOICES
from shm.layout import InstanceLayout
from shm.messages import (
    ClusterStatus,
    EngineStatus,
    LlmAppendText,
    LlmCancel,
    LlmSubmit,
    control_encoder,
    llm_control_decoder,
)
from shm.records import (
    FRAME_CODES,
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    RecordKind,
    StreamEnd,
    StreamError,
    gateway_of,
    record_encoder,
)
from shm.ring import RingWriter

log = logging.getLogger(__name__)

TONE_HZ = 200  # 24000 / 200 = 120 samples per period: a table of whole periods loops cleanly
_TABLE_PERIOD = SAMPLE_RATE  # one second of tone, an exact number of periods
_MAX_CHUNK = 8 * SAMPLES_PER_FRAME
_TONE = (
    np.sin(2 * np.pi * TONE_HZ * np.arange(_TABLE_PERIOD + _MAX_CHUNK) / SAMPLE_RATE) * 8000
).astype("<i2")
STATUS_PERIOD_S = 0.2


def synthetic_pcm(start_sample: int, samples: int) -> np.ndarray:
    """The samples the backend emits for a stream from ``start_sample`` on (a view)."""
    if samples > _MAX_CHUNK:
        raise ValueError(f"at most {_MAX_CHUNK} samples per chunk")
    off = start_sample % _TABLE_PERIOD
    return _TONE[off : off + samples]


class StreamPlan(msgspec.Struct, frozen=True, kw_only=True):
    """What the synthetic backend does with one ``LlmSubmit``."""

    frames: int
    """Audio frames to emit (for an open text: per piece of text, see ``frames_for_text``)."""
    frames_per_chunk: int = 1
    error: StreamError | None = None
    """Sent after ``error_after`` chunks instead of the rest of the stream."""
    error_after: int = 0
    skip_seq_at: int | None = None
    """Chunk index whose ``seq`` is skipped (a transport bug, for the gateway's gap check)."""
    stall_after: int | None = None
    """Stop after this many chunks without END (a hung worker)."""
    end_reason: str = "stop"


PlanFn = Callable[[LlmSubmit], StreamPlan]


def frames_for_text(text: str) -> int:
    """About one 85 ms frame per character: a stand-in for how long speech of a text is."""
    return len(text)


def default_plan(voices: Sequence[str]) -> PlanFn:
    known = frozenset(voices)

    def plan(submit: LlmSubmit) -> StreamPlan:
        if submit.voice not in known:
            return StreamPlan(
                frames=0,
                error=StreamError("bad_request", f"unknown voice {submit.voice!r}", 400),
            )
        if submit.sampling.max_tokens is not None:
            return StreamPlan(frames=submit.sampling.max_tokens // FRAME_CODES)
        return StreamPlan(frames=frames_for_text(submit.text))

    return plan


class _Stream:
    __slots__ = (
        "chunks_sent",
        "due",
        "frames_budget",
        "frames_sent",
        "plan",
        "scheduled",
        "seq",
        "stream_id",
        "text_open",
        "writer",
    )

    def __init__(self, submit: LlmSubmit, plan: StreamPlan, writer: RingWriter, due: float) -> None:
        self.stream_id = submit.stream_id
        self.plan = plan
        self.writer = writer
        self.due = due
        self.scheduled = True
        self.seq = 0
        self.chunks_sent = 0
        self.frames_sent = 0
        self.frames_budget = plan.frames
        self.text_open = submit.text_open


def ready_status(engines: int = 1) -> ClusterStatus:
    """Every engine and the codec ready, nothing draining."""
    return ClusterStatus(engines=(EngineStatus(True),) * engines, codec_ready=True, draining=False)


class SyntheticBackend:
    """Plays the llm_worker and codec_worker (and the orchestrator's status) for one instance."""

    def __init__(
        self,
        layout: InstanceLayout,
        *,
        plan: PlanFn | None = None,
        voices: Sequence[str] = ENGLISH_VOICES,
        realtime: bool = False,
        first_chunk_delay_s: float = 0.0,
        tick_s: float = 0.005,
        stamp: bool = False,
        status: ClusterStatus | Literal["ready"] | None = "ready",
        ring_timeout_s: float = 5.0,
        capacity: float | None = None,
    ) -> None:
        self.layout = layout
        self.capacity = capacity
        self.plan = plan or default_plan(voices)
        self.realtime = realtime
        self.first_chunk_delay_s = first_chunk_delay_s
        self.tick_s = tick_s
        self.stamp = stamp
        self.status = ready_status(layout.engines) if status == "ready" else status
        """Published every 0.2 s while not None; replace it to change what gateways see
        ("ready": every engine and the codec ready)."""
        self.ring_timeout_s = ring_timeout_s
        self._lock = threading.Lock()
        self.submits: list[LlmSubmit] = []
        self.appends: list[LlmAppendText] = []
        self.cancels: list[LlmCancel] = []
        self.engine_of: dict[int, set[int]] = {}
        """Stream id -> the engines whose control socket received a message of it."""
        self.chunks_written = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    # -- control from a test ---------------------------------------------------------------
    def start(self) -> SyntheticBackend:
        self._thread = threading.Thread(target=self.run, name="synthetic-backend", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("synthetic backend did not start")
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def cancelled_ids(self) -> set[int]:
        with self._lock:
            return {c.stream_id for c in self.cancels}

    def submitted(self) -> list[LlmSubmit]:
        with self._lock:
            return list(self.submits)

    # -- the loop --------------------------------------------------------------------------
    def run(self, stop: threading.Event | None = None) -> None:
        stop = stop or self._stop
        ctx = zmq.Context.instance()
        controls: list[zmq.Socket] = []
        poller = zmq.Poller()
        for e in range(self.layout.engines):
            sock = ctx.socket(zmq.PULL)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.layout.engine_control(e))
            poller.register(sock, zmq.POLLIN)
            controls.append(sock)
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.bind(self.layout.status)
        writers = [RingWriter(self.layout.pcm_ring(i)) for i in range(self.layout.gateways)]
        streams: dict[int, _Stream] = {}
        heap: list[tuple[float, int]] = []
        scratch = np.empty(_MAX_CHUNK, dtype="<i2")
        next_status = 0.0
        next_round = 0.0
        self._ready.set()
        try:
            while not stop.is_set():
                now = time.monotonic()
                if self.status is not None and now >= next_status:
                    pub.send(control_encoder.encode(self.status))
                    next_status = now + STATUS_PERIOD_S
                # Sleep until the next emission round is due (rounds are at least tick_s
                # apart when paced, like the codec worker's decode batches) or a message.
                wake = max(heap[0][0], next_round) if heap else now + self.tick_s
                timeout_ms = math.ceil(max(0.0, min(wake, next_status) - now) * 1000)
                for sock, _ in poller.poll(timeout_ms):
                    engine = controls.index(sock)
                    self._drain_control(sock, engine, streams, heap, writers)
                now = time.monotonic()
                if heap and heap[0][0] <= now and now >= next_round:
                    self._emit_due(streams, heap, scratch)
                    for w in writers:
                        w.publish()
                    if self.realtime:
                        next_round = now + self.tick_s
        finally:
            for w in writers:
                w.close()
            for sock in controls:
                sock.close(linger=0)
            pub.close(linger=0)

    def _drain_control(
        self,
        sock: zmq.Socket,
        engine: int,
        streams: dict[int, _Stream],
        heap: list[tuple[float, int]],
        writers: list[RingWriter],
    ) -> None:
        while True:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = llm_control_decoder.decode(raw)
            with self._lock:
                self.engine_of.setdefault(msg.stream_id, set()).add(engine)
            now = time.monotonic()
            if isinstance(msg, LlmSubmit):
                with self._lock:
                    self.submits.append(msg)
                plan = self.plan(msg)
                due = now + (self.first_chunk_delay_s if self.realtime else 0.0)
                s = _Stream(msg, plan, writers[gateway_of(msg.stream_id)], due)
                streams[msg.stream_id] = s
                heapq.heappush(heap, (due, msg.stream_id))
            elif isinstance(msg, LlmAppendText):
                with self._lock:
                    self.appends.append(msg)
                s2 = streams.get(msg.stream_id)
                if s2 is not None:
                    s2.frames_budget += frames_for_text(msg.text)
                    s2.text_open = not msg.final
                    if not s2.scheduled:
                        s2.due = max(now, s2.due)
                        s2.scheduled = True
                        heapq.heappush(heap, (s2.due, msg.stream_id))
            elif isinstance(msg, LlmCancel):
                with self._lock:
                    self.cancels.append(msg)
                s3 = streams.pop(msg.stream_id, None)
                if s3 is not None:
                    self._end(s3, "cancelled")

    def _end(self, s: _Stream, reason: str) -> None:
        end = StreamEnd(reason=reason, frames=s.frames_sent, tokens=s.frames_sent * FRAME_CODES)
        s.writer.append(
            RecordKind.END, s.stream_id, s.seq, record_encoder.encode(end), self.ring_timeout_s
        )

    def _emit_due(
        self, streams: dict[int, _Stream], heap: list[tuple[float, int]], scratch: np.ndarray
    ) -> None:
        now = time.monotonic()
        while heap and heap[0][0] <= now:
            _, sid = heapq.heappop(heap)
            s = streams.get(sid)
            if s is None:
                continue  # finished or cancelled
            s.scheduled = False
            if not self._emit_one(s, scratch):
                streams.pop(sid, None)
                continue
            if s.frames_sent < s.frames_budget:
                step = s.plan.frames_per_chunk * SAMPLES_PER_FRAME / SAMPLE_RATE
                if self.capacity:
                    step *= len(streams) / self.capacity
                s.due = s.due + step if self.realtime else now
                s.scheduled = True
                heapq.heappush(heap, (s.due, sid))
            elif not s.text_open:
                self._end(s, s.plan.end_reason)
                streams.pop(sid, None)
            # else: wait for more text (AppendText pushes the stream back on the heap)

    def _emit_one(self, s: _Stream, scratch: np.ndarray) -> bool:
        """Write the stream's next chunk; False when the stream is over (error or stall)."""
        plan = s.plan
        if plan.error is not None and s.chunks_sent >= plan.error_after:
            s.writer.append(
                RecordKind.ERROR, s.stream_id, s.seq, msgspec.msgpack.encode(plan.error), 5.0
            )
            return False
        if plan.stall_after is not None and s.chunks_sent >= plan.stall_after:
            return False
        if s.frames_sent >= s.frames_budget:
            return True
        frames = min(plan.frames_per_chunk, s.frames_budget - s.frames_sent)
        n = frames * SAMPLES_PER_FRAME
        pcm = synthetic_pcm(s.frames_sent * SAMPLES_PER_FRAME, n)
        if plan.skip_seq_at is not None and s.chunks_sent == plan.skip_seq_at:
            s.seq += 1
        if self.stamp:
            buf = scratch[:n]
            buf[:] = pcm
            buf[:4].view("<i8")[0] = time.monotonic_ns()
            pcm = buf
        s.writer.append(RecordKind.PCM, s.stream_id, s.seq, pcm, self.ring_timeout_s)
        s.seq += 1
        s.chunks_sent += 1
        s.frames_sent += frames
        self.chunks_written += 1
        return True
