"""The llm_worker's core: streams, their vLLM requests, and one code-ring publish per step.

Life of a stream::

    LlmSubmit ──validate──► pieces of text ──► segment 0 (vLLM request) ──► segment 1 ──► ... END
      │ bad input: ERROR 400, no engine work          each engine step: CODES records
      └ LlmCancel at any time: abort the request, END(reason="cancelled")

Frame ``seq`` counts the stream's frames across all of its segments, so long text comes
out as one continuous stream.

One task, the *pump*, is the only writer of the code ring. It wakes when the engine has
delivered a step's outputs (:meth:`LLMService.on_step`, called by the engine's step hook:
:class:`llm_worker.step_hooks.StepHook`), takes every live stream's new tokens, maps them all to
frames in one vectorised call, stages one CODES record per stream that completed frames, and
publishes them with one head update. Control handlers never write the ring: their END/ERROR
records go through an outbox the pump flushes after the step's CODES, so a stream's records
stay in order (and a traced stream's START record, queued at submit, is written before its
first CODES).

Tracing (``common.tracing``, when on and the ``LlmSubmit`` carries a ``traceparent``): a
stream is one ``llm.stream`` span (voice, segments as events, tokens, frames, its outcome,
cancellation), with a child ``llm.prefill`` span from the submit to the first sampled token
(the engine's queue and the prefill). Its context goes to the codec worker in the ``START``
record. No per-token work: the first token is one test per stream and step.

A full ring is backpressure: the pump waits (the whole ring is shared, so every stream
waits with it) and, past ``ring_full_timeout_s``, fails the stream it was writing with
ERROR "backpressure" and aborts its request.

The service sees the engine through :class:`Engine` (``add``/``abort`` and the output
collectors of :mod:`llm_worker.engine`) and the ring through a
:class:`llm_worker.output.RecordSink`, so that unit tests drive it with fakes of both.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
import numpy as np
from vllm.v1.engine.exceptions import EngineDeadError

from common.llm_config import LLMConfig
from common.voice_lookup import VoiceLookup
from llm_worker import metrics as M
from llm_worker.codes import FrameAssembler
from llm_worker.custom_voices import ZeroShotVoices
from llm_worker.model_info import ModelInfo
from llm_worker.output import Payload, RecordSink
from llm_worker.prompt import PromptBuilder
from llm_worker.repetition import RepetitionGuard
from llm_worker.requests import (
    EMPTY_TEXT,
    BadRequest,
    RequestPlan,
    plan_request,
    segment_params,
    split_budget,
)
from llm_worker.text import TextStream, normalise_tags, split_text
from llm_worker.vllm_ext.sampling.hooks import SamplingHooks
from llm_worker.vllm_ext.token_space import TokenSpace
from shm.messages import LlmAppendText, LlmCancel, LlmControl, LlmSubmit
from shm.records import (
    CODE_DTYPE,
    FRAME_CODES,
    RecordKind,
    StreamEnd,
    StreamError,
    StreamStart,
    record_encoder,
)

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from common.tracing import Tracing
    from llm_worker.lora import LoraVoices

log = logging.getLogger(__name__)

# How bad a segment's ending was: a stream reports the worst of its segments.
_SEVERITY = {"stop": 0, "length": 1, "repetition": 2}
_FRAME_BYTES = FRAME_CODES * CODE_DTYPE.itemsize
_OUTBOX_RETRY_S = 0.05


# -- what the service needs of the engine --------------------------------------------------


class Completion(Protocol):
    """vLLM's ``CompletionOutput`` as read here (DELTA: the step's new tokens)."""

    token_ids: Sequence[int]
    finish_reason: str | None


class StepOutput(Protocol):
    """vLLM's ``RequestOutput`` as read here."""

    finished: bool
    outputs: Sequence[Completion]


class Collector(Protocol):
    """A request's outputs (vLLM's ``RequestOutputCollector``): what arrived since the last
    call, or None; raises the request's error (EngineDeadError if the engine died)."""

    def get_nowait(self) -> StepOutput | None: ...


class Engine(Protocol):
    """:class:`llm_worker.engine.GenerationEngine`, as the service uses it."""

    space: TokenSpace
    """The engine's token ids: prompts go in as the checkpoint's (``add`` converts them),
    sampled ids come out as the engine's."""

    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> Collector: ...

    async def abort(self, request_id: str) -> None: ...


# -- the service ---------------------------------------------------------------------------


@dataclass(slots=True, eq=False)
class LlmStream:
    stream_id: int
    plan: RequestPlan
    row: int
    pieces: deque[str]
    """Text not yet started, in order."""
    budgets: deque[int] | None
    """Exact tokens of each piece (fixed-length requests), else None."""
    text: TextStream | None
    """Open text (``text_open``): more may arrive. None once the text is complete."""
    sampling_kwargs: dict[str, Any] | None = None
    """The requests' sampling keywords, built once when the stream starts (sampling hooks)."""
    prefix: tuple[int, ...] | None = None
    """A custom voice's prompt prefix (its reference turn), fixed when the stream starts."""
    lora: LoRARequest | None = None
    """A LoRA voice's adapter, fixed when the stream starts."""
    speaker: str = ""
    """The name in the prompt ``"{speaker}: {text}"`` (built-in and LoRA voices)."""
    counter: Any = None
    """The stream's slot on the prevented-token board (sampling package), if any."""
    segment: int = -1
    request_id: str | None = None
    collector: Collector | None = None
    frames: int = 0
    tokens: int = 0
    reason: str = "stop"
    done: bool = False
    span: Span | None = None
    """The stream's ``llm.stream`` span (tracing on and the request traced)."""
    prefill: Span | None = None
    """Its ``llm.prefill`` span until the first token arrives."""


class LLMService:
    def __init__(
        self,
        config: LLMConfig,
        engine: Engine,
        sink: RecordSink,
        prompts: PromptBuilder,
        info: ModelInfo,
        sampling: SamplingHooks | None = None,
        custom: ZeroShotVoices | None = None,
        loras: LoraVoices | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._config = config
        self.tracing = tracing
        self._starts: list[LlmStream] = []
        """Traced streams whose START record the pump has yet to write (before any CODES)."""
        self._custom = custom
        self._loras = loras
        self._voices = VoiceLookup(
            info.voices,
            None if loras is None else (lambda v: loras.get(v) is not None),
            None if custom is None else custom.has,
        )
        """The voices this worker takes, looked up in the gateway's order (common.voice_lookup)."""
        self._engine = engine
        self._space = engine.space
        self._sink = sink
        self._prompts = prompts
        self._info = info
        self._tags = frozenset(info.emotion_tags)
        self._sampling = sampling or SamplingHooks()
        self._streams: dict[int, LlmStream] = {}
        self._live: dict[int, LlmStream] = {}
        """Streams with a request in the engine."""
        self._assembler = FrameAssembler(capacity=64)
        self._guard = RepetitionGuard(config.repetition_guard_frames, capacity=64)
        self._wake = asyncio.Event()
        self._outbox: deque[tuple[LlmStream | _Orphan, StreamEnd | StreamError]] = deque()
        """END/ERROR records the pump writes after the step's CODES (see the module doc)."""
        self._max_frames_per_record = max(1, (sink.max_payload // _FRAME_BYTES))
        # One step's outputs, reused from step to step.
        self._step_streams: list[LlmStream] = []
        self._step_tokens: list[Sequence[int]] = []
        self._step_finished: list[str | None] = []

    # -- public -------------------------------------------------------------------------

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    def on_step(self) -> None:
        """Called by the engine's step hook once a step's outputs are all delivered."""
        self._wake.set()

    async def handle(self, msg: LlmControl) -> None:
        """Apply one control message. A bug while handling it fails that stream only."""
        try:
            if isinstance(msg, LlmSubmit):
                await self._submit(msg)
            elif isinstance(msg, LlmAppendText):
                await self._append(msg)
            elif isinstance(msg, LlmCancel):
                await self._cancel(msg)
        except EngineDeadError:
            raise
        except Exception as e:
            log.exception("stream %#x: %s failed", msg.stream_id, type(msg).__name__)
            s = self._streams.get(msg.stream_id)
            message = f"internal error: {type(e).__name__}: {e}"
            if s is not None:
                await self._fail(s, "internal_error", message, 500)
            elif isinstance(msg, LlmSubmit):
                self._reject(msg.stream_id, message, "internal_error", 500)

    async def run(self) -> None:
        """The pump: runs until cancelled; raises EngineDeadError if the engine dies."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.pump()

    async def shutdown(self, code: str = "shutdown", message: str = "the worker stopped") -> None:
        """Fail every stream (ERROR 503) and publish; the engine may already be gone."""
        for s in list(self._streams.values()):
            await self._fail(s, code, message, 503, abort=False)
        await self._flush_outbox()
        self._sink.publish()

    # -- control messages ---------------------------------------------------------------

    async def _submit(self, msg: LlmSubmit) -> None:
        if msg.stream_id in self._streams:
            log.error("duplicate stream id %#x ignored (a gateway bug)", msg.stream_id)
            return
        try:
            plan = plan_request(msg, self._config, self._info, self._voices)
            prefix: tuple[int, ...] | None = None
            lora: LoRARequest | None = None
            speaker = plan.voice
            if plan.kind == "lora":
                assert self._loras is not None
                lv = self._loras.get(plan.voice)
                if lv is None:  # unloaded since the lookup
                    raise BadRequest(self._voices.unknown(msg.voice))
                lora, speaker = lv.request, lv.speaker
            elif plan.kind == "custom":
                assert self._custom is not None
                prefix = self._custom.prefix(plan.voice)
                if prefix is None:  # deleted since the lookup
                    raise BadRequest(self._voices.unknown(msg.voice))
        except BadRequest as e:
            self._reject(msg.stream_id, str(e), e.code)
            return
        row = self._assembler.open()
        self._guard.ensure_capacity(self._assembler.capacity)
        text = TextStream(self._config.max_chars_per_segment) if msg.text_open else None
        if text is not None:
            pieces = deque(text.feed(msg.text))
            budgets = None
        else:
            parts = split_text(msg.text, self._config.max_chars_per_segment)
            pieces = deque(parts)
            budgets = (
                None
                if plan.total_tokens is None
                else deque(split_budget(plan.total_tokens, [len(p) for p in parts]))
            )
        s = LlmStream(msg.stream_id, plan, row, pieces, budgets, text)
        s.prefix, s.lora, s.speaker = prefix, lora, speaker
        s.counter = self._sampling.acquire()
        s.sampling_kwargs = self._sampling.kwargs(plan.sampling, s.counter)
        self._streams[s.stream_id] = s
        M.ACTIVE_STREAMS.inc()
        if self.tracing is not None and msg.traceparent:
            self._trace(s, msg)
        await self._advance(s)

    def _trace(self, s: LlmStream, msg: LlmSubmit) -> None:
        """Open the stream's spans and queue its START record for the codec worker."""
        assert self.tracing is not None
        attributes = {
            "orpheus.stream_id": f"{s.stream_id:#x}", "orpheus.voice": msg.voice,
            "orpheus.voice_kind": s.plan.kind, "orpheus.text_chars": len(msg.text),
            "orpheus.text_open": msg.text_open,
        }  # fmt: skip
        s.span = self.tracing.start("llm.stream", msg.traceparent, attributes=attributes)
        s.prefill = self.tracing.start("llm.prefill", parent=s.span)
        self._starts.append(s)

    async def _append(self, msg: LlmAppendText) -> None:
        s = self._streams.get(msg.stream_id)
        if s is None or s.done:
            return  # finished or cancelled already: nothing to do
        if s.text is None:
            log.warning("AppendText for stream %#x whose text is closed: ignored", s.stream_id)
            return
        s.pieces.extend(s.text.feed(msg.text))
        if msg.final:
            s.pieces.extend(s.text.close())
            s.text = None
        await self._advance(s)

    async def _cancel(self, msg: LlmCancel) -> None:
        s = self._streams.get(msg.stream_id)
        if s is None or s.done:
            return
        if s.span is not None:
            s.span.add_event("cancelled", {"orpheus.reason": msg.reason})
        await self._stop_request(s, "cancelled")
        s.reason = "cancelled"
        self._finish(s)
        log.debug("stream %#x cancelled: %s", s.stream_id, msg.reason)

    def _reject(
        self, stream_id: int, message: str, code: str = "bad_request", status: int = 400
    ) -> None:
        """An ERROR for a request that never became a stream (no engine work was done)."""
        M.STREAMS.labels(M.ENGINE, "bad_request" if status == 400 else "error").inc()
        err = StreamError(code=code, message=message, status=status)
        self._outbox.append((_Orphan(stream_id), err))
        self._wake.set()

    # -- segments -----------------------------------------------------------------------

    async def _advance(self, s: LlmStream) -> None:
        """Start the stream's next piece of text, or end it when all text is spoken."""
        while not s.done and s.request_id is None:
            if s.pieces:
                text = s.pieces.popleft()
                budget = s.budgets.popleft() if s.budgets else None
                if budget == 0:
                    continue  # a fixed length too small to share with this piece
                await self._start_segment(s, text, budget)
                return
            if s.text is not None:
                return  # open text: wait for more
            if s.segment < 0:
                await self._fail(s, EMPTY_TEXT, "empty text: there is nothing to say", 400)
            else:
                self._finish(s)
            return

    async def _start_segment(self, s: LlmStream, text: str, budget: int | None) -> None:
        s.segment += 1
        spoken = normalise_tags(text, self._tags)
        if s.prefix is not None:
            prompt = [*s.prefix, *self._prompts.build_plain(spoken)]
        else:
            prompt = self._prompts.build(s.speaker, spoken)
        try:
            params = segment_params(
                self._config,
                s.plan,
                s.segment,
                len(text),
                len(prompt),
                budget,
                s.sampling_kwargs,
                stop_id=self._space.end_of_speech,
            )
        except BadRequest as e:
            await self._fail(s, e.code, str(e), 400)
            return
        rid = f"{s.stream_id:x}-{s.segment}"
        self._assembler.reset(s.row)
        self._guard.reset(s.row)
        try:
            s.collector = await self._engine.add(rid, prompt, params, s.lora)
        except EngineDeadError:
            raise
        except ValueError as e:  # vLLM's validation errors are ValueErrors
            await self._fail(s, "bad_request", f"rejected by the engine: {e}", 400)
            return
        except Exception as e:
            log.exception("stream %#x: add_request failed", s.stream_id)
            await self._fail(s, "engine_error", f"{type(e).__name__}: {e}", 500)
            return
        M.SEGMENTS.inc()
        if s.span is not None:
            s.span.add_event(
                "segment", {"orpheus.segment": s.segment, "orpheus.prompt_tokens": len(prompt)}
            )
        if s.done:  # cancelled or failed while the request was being added
            await self._engine.abort(rid)
            return
        s.request_id = rid
        self._live[s.stream_id] = s

    def _end_segment(self, s: LlmStream, reason: str) -> None:
        if self._assembler.pending_tokens(s.row):
            M.FRAMES_DROPPED.labels(M.ENGINE, "incomplete").inc()
        if _SEVERITY.get(reason, 0) > _SEVERITY.get(s.reason, 0):
            s.reason = reason
        s.request_id = None
        s.collector = None
        self._live.pop(s.stream_id, None)

    async def _stop_request(self, s: LlmStream, reason: str) -> None:
        """End the current segment early (cancel, repetition, failure) and abort it in vLLM."""
        rid = s.request_id
        if rid is None:
            return
        self._end_segment(s, reason)
        try:
            await self._engine.abort(rid)
        except EngineDeadError:
            pass  # nothing left to abort

    # -- endings ------------------------------------------------------------------------

    def _close(self, s: LlmStream, outcome: str) -> int:
        """Drop the stream's state; returns its prevented-token count."""
        s.done = True
        self._streams.pop(s.stream_id, None)
        self._live.pop(s.stream_id, None)
        self._assembler.close(s.row)
        prevented = self._sampling.release(s.counter) if s.counter is not None else 0
        M.ACTIVE_STREAMS.dec()
        M.STREAMS.labels(M.ENGINE, outcome).inc()
        if s.span is not None:
            self._end_trace(s, outcome, prevented)
        return prevented

    def _end_trace(self, s: LlmStream, outcome: str, prevented: int) -> None:
        """End the stream's spans (a failure's code and message are its ``failed`` event)."""
        from opentelemetry.trace import Status, StatusCode

        assert s.span is not None
        if s.prefill is not None:
            s.prefill.end()
            s.prefill = None
        s.span.set_attributes(
            {
                "orpheus.outcome": outcome, "orpheus.tokens": s.tokens,
                "orpheus.frames": s.frames, "orpheus.segments": s.segment + 1,
                "orpheus.invalid_tokens_prevented": prevented,
            }
        )  # fmt: skip
        if outcome in ("bad_request", "error"):
            s.span.set_status(Status(StatusCode.ERROR, outcome))
        s.span.end()
        s.span = None

    def _finish(self, s: LlmStream) -> None:
        prevented = self._close(s, s.reason)
        end = StreamEnd(
            reason=s.reason, frames=s.frames, tokens=s.tokens, invalid_tokens_prevented=prevented
        )
        self._outbox.append((s, end))
        self._wake.set()

    async def _fail(
        self, s: LlmStream, code: str, message: str, status: int, abort: bool = True
    ) -> None:
        if s.done:
            return
        if abort:
            await self._stop_request(s, s.reason)
        if s.span is not None:
            s.span.set_attribute("orpheus.error_code", code)
            s.span.add_event("failed", {"orpheus.error_code": code, "message": message})
        self._close(s, "bad_request" if status == 400 else "error")
        err = StreamError(code=code, message=message, status=status)
        self._outbox.append((s, err))
        self._wake.set()
        if status >= 500:
            log.warning("stream %#x failed: %s: %s", s.stream_id, code, message)

    # -- the pump -----------------------------------------------------------------------

    async def pump(self) -> None:
        """Publish what the engine delivered since the last call: every live stream's new
        frames (one head update), then the endings they caused and the queued END/ERROR
        records (:meth:`run` calls it after each engine step)."""
        t0 = time.perf_counter()
        if self._starts:
            await self._flush_starts()
        streams, token_lists, finished = self._step_streams, self._step_tokens, self._step_finished
        streams.clear()
        token_lists.clear()
        finished.clear()
        broken: list[tuple[LlmStream, Exception]] | None = None
        eos = self._space.end_of_speech
        for s in self._live.values():
            try:
                out = s.collector.get_nowait() if s.collector is not None else None
            except EngineDeadError:
                raise
            except Exception as e:
                if broken is None:
                    broken = []
                broken.append((s, e))
                continue
            if out is None:
                continue
            comp = out.outputs[0]
            ids = comp.token_ids
            reason = comp.finish_reason if out.finished else None
            if reason == "stop" and ids and ids[-1] == eos:
                ids = ids[:-1]  # the stop token is not audio
            streams.append(s)
            token_lists.append(ids)
            finished.append(reason)

        if streams:
            await self._publish_step(streams, token_lists, finished)
        if broken is not None:
            for s, e in broken:
                await self._fail(s, "engine_error", f"{type(e).__name__}: {e}", 500)
        await self._flush_outbox()
        self._sink.publish()
        if streams:
            M.STEP_SECONDS.observe(time.perf_counter() - t0)

    async def _publish_step(
        self, streams: list[LlmStream], token_lists: list[Sequence[int]], finished: list[str | None]
    ) -> None:
        n = len(streams)
        lens = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=n)
        total = int(lens.sum())
        tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
        self._space.from_engine_(tokens)  # engine ids -> the checkpoint's (output head)
        rows = np.fromiter((s.row for s in streams), dtype=np.int64, count=n)
        step = self._assembler.map(rows, lens, tokens)
        looping = self._guard.observe(rows, step.frames, step.counts)
        offsets = step.offsets()
        M.TOKENS_PER_STEP.observe(total)
        M.FRAMES_WRITTEN.inc(int(offsets[-1]))
        if n_invalid := int(step.invalid_tokens.sum()):
            M.INVALID_TOKENS.inc(n_invalid)
        # A frame is dropped in the step that completes it, often not the one that brought
        # its invalid token.
        if n_dropped := int(step.dropped.sum()):
            M.FRAMES_DROPPED.labels(M.ENGINE, "invalid").inc(n_dropped)

        counts = step.counts.tolist()
        bounds = offsets.tolist()
        n_tokens = lens.tolist()
        frames = step.frames
        try_put, codes = self._sink.try_put, RecordKind.CODES
        per_record = self._max_frames_per_record
        for i, s in enumerate(streams):
            if s.prefill is not None and n_tokens[i]:
                s.prefill.end()  # the first token (only traced streams have a span)
                s.prefill = None
            s.tokens += n_tokens[i]
            if counts[i] and not s.done:
                mine = frames[bounds[i] : bounds[i + 1]]
                # The usual case (one record, room in the ring) costs no coroutine.
                if counts[i] <= per_record and try_put(codes, s.stream_id, s.frames, mine):
                    s.frames += counts[i]
                else:
                    await self._write_frames(s, mine)
        self._sink.publish()  # one head update for every stream's frames of this step
        for i, s in enumerate(streams):
            if s.done:
                continue
            reason = finished[i]
            if reason is None and looping[i]:
                M.REPETITION_STOPS.inc()
                log.info("stream %#x: repetition guard ended segment %d", s.stream_id, s.segment)
                await self._stop_request(s, "repetition")
                await self._advance(s)
            elif reason in ("stop", "length"):
                self._end_segment(s, reason)
                await self._advance(s)
            elif reason is not None:
                await self._fail(s, "engine_error", f"generation ended with {reason!r}", 500)

    async def _write_frames(self, s: LlmStream, frames: np.ndarray) -> None:
        step = self._max_frames_per_record
        for a in range(0, len(frames), step):
            if s.done:  # cancelled or failed while this step's records were waiting
                return
            chunk = frames[a : a + step]
            if not await self._put(s, RecordKind.CODES, s.frames, chunk):
                return
            s.frames += len(chunk)

    async def _flush_starts(self) -> None:
        """Write the START records of the streams traced since the last step (before their
        first CODES: a step's CODES are staged after this)."""
        assert self.tracing is not None
        starts, self._starts = self._starts, []
        for s in starts:
            if s.done or s.span is None:
                continue
            start = StreamStart(self.tracing.traceparent(s.span), s.plan.voice)
            await self._put(s, RecordKind.START, 0, record_encoder.encode(start), final=True)

    async def _flush_outbox(self) -> None:
        """Write the queued END/ERROR records, in order. If the ring stays full they stay
        queued and the pump retries shortly: an END or ERROR is never dropped."""
        while self._outbox:
            s, msg = self._outbox[0]
            if isinstance(msg, StreamEnd):
                # A CODES record in flight when the stream ended still counts.
                msg = msgspec.structs.replace(msg, frames=s.frames)
                kind = RecordKind.END
            else:
                kind = RecordKind.ERROR
            if not await self._put(s, kind, s.frames, record_encoder.encode(msg), final=True):
                asyncio.get_running_loop().call_later(_OUTBOX_RETRY_S, self._wake.set)
                return
            self._outbox.popleft()

    async def _put(
        self,
        s: LlmStream | _Orphan,
        kind: RecordKind,
        seq: int,
        payload: Payload,
        final: bool = False,
    ) -> bool:
        """Stage one record; wait while the ring is full. Past the sink's timeout a CODES
        record fails its stream (ERROR "backpressure"); a ``final`` record (END/ERROR) stays
        queued."""
        if self._sink.try_put(kind, s.stream_id, seq, payload):
            return True
        if await self._sink.wait_put(kind, s.stream_id, seq, payload):
            return True
        if final:
            log.warning("code ring full: %s of stream %#x waits", kind.name, s.stream_id)
        elif isinstance(s, LlmStream):
            await self._fail(s, "backpressure", "the codec worker fell behind", 503)
        return False


@dataclass(slots=True, frozen=True)
class _Orphan:
    """The addressee of a record for a request that never became a stream."""

    stream_id: int
    frames: int = 0
