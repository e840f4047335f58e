"""The one owner of a stream's life in the llm worker: it opens a stream (its frame row, its
sampling slot), marks the request of each segment live and ended, aborts it in the engine,
and closes the stream (row and slot given back, metrics, spans) with exactly one END or ERROR
queued in the outbox, which the publisher writes after the step's CODES
(:mod:`llm_worker.publisher`). The intake (:mod:`llm_worker.intake`) and the publisher both
end streams, always through here."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.v1.engine.exceptions import EngineDeadError

from llm_worker import metrics as M
from llm_worker.codes import FrameAssembler
from llm_worker.repetition import RepetitionGuard
from llm_worker.requests import RequestPlan
from llm_worker.stream import Collector, Engine, LlmStream, Orphan
from llm_worker.text import TextStream
from llm_worker.vllm_ext.sampling.hooks import SamplingHooks
from shm.records import StreamEnd, StreamError

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

log = logging.getLogger(__name__)

# How bad a segment's ending was: a stream reports the worst of its segments.
_SEVERITY = {"stop": 0, "length": 1, "repetition": 2}


class StreamLifecycle:
    def __init__(
        self,
        engine: Engine,
        sampling: SamplingHooks,
        repetition_guard_frames: int,
        wake: Callable[[], None],
    ) -> None:
        self._engine = engine
        self._sampling = sampling
        self._wake = wake
        """Asks the publisher to run (an ending was queued)."""
        self.streams: dict[int, LlmStream] = {}
        """Every open stream."""
        self.live: dict[int, LlmStream] = {}
        """Streams with a request in the engine: the publisher reads their outputs."""
        self.outbox: deque[tuple[LlmStream | Orphan, StreamEnd | StreamError]] = deque()
        """END/ERROR records, in the order the streams ended; the publisher writes them."""
        self._starts: list[LlmStream] = []
        """Traced streams whose START record the publisher has yet to write."""
        self.assembler = FrameAssembler(capacity=64)
        """Each stream's row of tokens not yet a whole frame (the publisher maps into it)."""
        self.guard = RepetitionGuard(repetition_guard_frames, capacity=64)

    def open(
        self,
        stream_id: int,
        plan: RequestPlan,
        pieces: deque[str],
        budgets: deque[int] | None,
        text: TextStream | None,
        prefix: tuple[int, ...] | None,
        lora: LoRARequest | None,
        speaker: str,
    ) -> LlmStream:
        row = self.assembler.open()
        self.guard.ensure_capacity(self.assembler.capacity)
        s = LlmStream(stream_id, plan, row, pieces, budgets, text)
        s.prefix, s.lora, s.speaker = prefix, lora, speaker
        s.counter = self._sampling.acquire()
        s.sampling_kwargs = self._sampling.kwargs(plan.sampling, s.counter)
        self.streams[stream_id] = s
        M.ACTIVE_STREAMS.inc()
        return s

    def queue_start(self, s: LlmStream) -> None:
        """A traced stream's START record is due before its first CODES."""
        self._starts.append(s)

    def take_starts(self) -> list[LlmStream]:
        """The streams whose START record is due (emptied: each is written once)."""
        starts, self._starts = self._starts, []
        return starts

    @property
    def has_starts(self) -> bool:
        return bool(self._starts)

    def new_segment(self, s: LlmStream) -> None:
        """A new request of the stream is about to start: its row starts afresh."""
        self.assembler.reset(s.row)
        self.guard.reset(s.row)

    def segment_live(self, s: LlmStream, request_id: str, collector: Collector) -> None:
        s.request_id = request_id
        s.collector = collector
        self.live[s.stream_id] = s

    def end_segment(self, s: LlmStream, reason: str) -> None:
        if self.assembler.pending_tokens(s.row):
            M.FRAMES_DROPPED.labels(M.ENGINE, "incomplete").inc()
        if _SEVERITY.get(reason, 0) > _SEVERITY.get(s.reason, 0):
            s.reason = reason
        s.request_id = None
        s.collector = None
        self.live.pop(s.stream_id, None)

    async def stop_request(self, s: LlmStream, reason: str) -> None:
        """End the current segment early (cancel, repetition, failure) and abort it in vLLM."""
        rid = s.request_id
        if rid is None:
            return
        self.end_segment(s, reason)
        try:
            await self._engine.abort(rid)
        except EngineDeadError:
            pass  # nothing left to abort

    def finish(self, s: LlmStream) -> None:
        """The stream ended whole (or was cancelled): its END is queued."""
        prevented = self._close(s, s.reason)
        end = StreamEnd(
            reason=s.reason, frames=s.frames, tokens=s.tokens, invalid_tokens_prevented=prevented
        )
        self.outbox.append((s, end))
        self._wake()

    async def fail(
        self, s: LlmStream, code: str, message: str, status: int, abort: bool = True
    ) -> None:
        """The stream failed: its request is aborted (``abort``) and its ERROR queued."""
        if s.done:
            return
        if abort:
            await self.stop_request(s, s.reason)
        if s.span is not None:
            s.span.set_attribute("orpheus.error_code", code)
            s.span.add_event("failed", {"orpheus.error_code": code, "message": message})
        self._close(s, "bad_request" if status == 400 else "error")
        self.outbox.append((s, StreamError(code=code, message=message, status=status)))
        self._wake()
        if status >= 500:
            log.warning("stream %#x failed: %s: %s", s.stream_id, code, message)

    def reject(
        self, stream_id: int, message: str, code: str = "bad_request", status: int = 400
    ) -> None:
        """An ERROR for a request that never became a stream (no engine work was done)."""
        M.STREAMS.labels(M.ENGINE, "bad_request" if status == 400 else "error").inc()
        err = StreamError(code=code, message=message, status=status)
        self.outbox.append((Orphan(stream_id), err))
        self._wake()

    def _close(self, s: LlmStream, outcome: str) -> int:
        """Drop the stream's state; returns its prevented-token count."""
        s.done = True
        self.streams.pop(s.stream_id, None)
        self.live.pop(s.stream_id, None)
        self.assembler.close(s.row)
        prevented = self._sampling.release(s.counter) if s.counter is not None else 0
        M.ACTIVE_STREAMS.dec()
        M.STREAMS.labels(M.ENGINE, outcome).inc()
        if s.span is not None:
            _end_trace(s, outcome, prevented)
        return prevented


def _end_trace(s: LlmStream, outcome: str, prevented: int) -> None:
    """End the stream's spans (a failure's code and message are its ``failed`` event)."""
    from opentelemetry.trace import Status, StatusCode

    assert s.span is not None
    if s.prefill is not None:
        s.prefill.end()
        s.prefill = None
    attributes: dict[str, Any] = {
        "orpheus.outcome": outcome, "orpheus.tokens": s.tokens,
        "orpheus.frames": s.frames, "orpheus.segments": s.segment + 1,
        "orpheus.invalid_tokens_prevented": prevented,
    }  # fmt: skip
    s.span.set_attributes(attributes)
    if outcome in ("bad_request", "error"):
        s.span.set_status(Status(StatusCode.ERROR, outcome))
    s.span.end()
    s.span = None
