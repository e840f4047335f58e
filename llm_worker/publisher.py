"""Each engine step out of the llm worker: the only writer of the code ring.

It runs when the engine has delivered a step's outputs (``LLMService.on_step``, called by the
engine's step hook: :class:`llm_worker.engine.step_hooks.StepHook`), takes every live stream's new
tokens, maps them all to frames in one vectorised call, stages one CODES record per stream
that completed frames, and publishes them with one head update. Then it ends the segments
that finished (the next piece starts through the intake's ``advance``) and writes the
outbox's END/ERROR records, so a stream's records stay in order (a traced stream's START
record, queued at submit, is written before its first CODES).

A full ring is backpressure: the publisher waits (the whole ring is shared, so every stream
waits with it) and, past ``ring_full_timeout_s``, fails the stream it was writing with
ERROR "backpressure" and aborts its request."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from itertools import chain
from typing import TYPE_CHECKING

import msgspec
import numpy as np
from vllm.v1.engine.exceptions import EngineDeadError

from llm_worker import metrics as M
from llm_worker.lifecycle import StreamLifecycle
from llm_worker.output import Payload, RecordSink
from llm_worker.stream import LlmStream, Orphan
from llm_worker.vllm_ext.token_space import TokenSpace
from shm.records import (
    CODE_DTYPE,
    FRAME_CODES,
    RecordKind,
    StreamEnd,
    StreamStart,
    record_encoder,
)

if TYPE_CHECKING:
    from common.tracing import Tracing

log = logging.getLogger(__name__)

_FRAME_BYTES = FRAME_CODES * CODE_DTYPE.itemsize
_OUTBOX_RETRY_S = 0.05


class StepPublisher:
    def __init__(
        self,
        lifecycle: StreamLifecycle,
        sink: RecordSink,
        space: TokenSpace,
        advance: Callable[[LlmStream], Awaitable[None]],
        wake: Callable[[], None],
        tracing: Tracing | None = None,
    ) -> None:
        self._life = lifecycle
        self._sink = sink
        self._space = space
        self._advance = advance
        """Starts a stream's next segment (the intake's) once one ends."""
        self._wake = wake
        self._tracing = tracing
        self._max_frames_per_record = max(1, (sink.max_payload // _FRAME_BYTES))
        # One step's outputs, reused from step to step.
        self._step_streams: list[LlmStream] = []
        self._step_tokens: list[Sequence[int]] = []
        self._step_finished: list[str | None] = []

    async def pump(self) -> None:
        """Publish what the engine delivered since the last call: every live stream's new
        frames (one head update), then the endings they caused and the queued END/ERROR
        records (``LLMService.run`` calls it after each engine step)."""
        t0 = time.perf_counter()
        if self._life.has_starts:
            await self._flush_starts()
        streams, token_lists, finished = self._step_streams, self._step_tokens, self._step_finished
        streams.clear()
        token_lists.clear()
        finished.clear()
        broken: list[tuple[LlmStream, Exception]] | None = None
        eos = self._space.end_of_speech
        for s in self._life.live.values():
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
                await self._life.fail(s, "engine_error", f"{type(e).__name__}: {e}", 500)
        await self.flush_outbox()
        self._sink.publish()
        if streams:
            M.STEP_SECONDS.observe(time.perf_counter() - t0)

    async def flush_outbox(self) -> None:
        """Write the queued END/ERROR records, in order. If the ring stays full they stay
        queued and the pump retries shortly: an END or ERROR is never dropped."""
        outbox = self._life.outbox
        while outbox:
            s, msg = outbox[0]
            if isinstance(msg, StreamEnd):
                # A CODES record in flight when the stream ended still counts.
                msg = msgspec.structs.replace(msg, frames=s.frames)
                kind = RecordKind.END
            else:
                kind = RecordKind.ERROR
            if not await self._put(s, kind, s.frames, record_encoder.encode(msg), final=True):
                asyncio.get_running_loop().call_later(_OUTBOX_RETRY_S, self._wake)
                return
            outbox.popleft()

    async def _publish_step(
        self, streams: list[LlmStream], token_lists: list[Sequence[int]], finished: list[str | None]
    ) -> None:
        n = len(streams)
        lens = np.fromiter((len(t) for t in token_lists), dtype=np.int64, count=n)
        total = int(lens.sum())
        tokens = np.fromiter(chain.from_iterable(token_lists), dtype=np.int64, count=total)
        self._space.from_engine_(tokens)  # engine ids -> the checkpoint's (output head)
        rows = np.fromiter((s.row for s in streams), dtype=np.int64, count=n)
        step = self._life.assembler.map(rows, lens, tokens)
        looping = self._life.guard.observe(rows, step.frames, step.counts)
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
                await self._life.stop_request(s, "repetition")
                await self._advance(s)
            elif reason in ("stop", "length"):
                self._life.end_segment(s, reason)
                await self._advance(s)
            elif reason is not None:
                await self._life.fail(s, "engine_error", f"generation ended with {reason!r}", 500)

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
        assert self._tracing is not None
        for s in self._life.take_starts():
            if s.done or s.span is None:
                continue
            start = StreamStart(self._tracing.traceparent(s.span), s.plan.voice)
            await self._put(s, RecordKind.START, 0, record_encoder.encode(start), final=True)

    async def _put(
        self,
        s: LlmStream | Orphan,
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
            await self._life.fail(s, "backpressure", "the codec worker fell behind", 503)
        return False
