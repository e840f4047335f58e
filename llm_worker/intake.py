"""Requests into the llm worker: ``LlmSubmit``, ``LlmAppendText`` and ``LlmCancel`` become
streams and their vLLM requests.

A submit is validated and planned (voice, sampling, budget: :mod:`llm_worker.requests`); bad
input is an ERROR 400 with no engine work. Its text is cut into pieces
(:mod:`llm_worker.text`), and each piece is one vLLM request, started when the one before it
ends (:meth:`Intake.advance`, which the publisher calls when a segment ends), so long text
comes out as one continuous stream. Streams are opened, ended and failed through
:class:`llm_worker.lifecycle.StreamLifecycle`; nothing here writes the code ring."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

from vllm.v1.engine.exceptions import EngineDeadError

from common.config.llm import LLMConfig
from common.voice_lookup import VoiceLookup
from llm_worker import metrics as M
from llm_worker.lifecycle import StreamLifecycle
from llm_worker.model_info import ModelInfo
from llm_worker.prompt import PromptBuilder
from llm_worker.requests import (
    EMPTY_TEXT,
    BadRequest,
    plan_request,
    segment_params,
    split_budget,
)
from llm_worker.stream import Engine, LlmStream
from llm_worker.text import TextStream, normalise_tags, split_text
from llm_worker.voices.custom import ZeroShotVoices
from shm.messages import LlmAppendText, LlmCancel, LlmControl, LlmSubmit

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

    from common.tracing import Tracing
    from llm_worker.voices.lora import LoraVoices

log = logging.getLogger(__name__)


class Intake:
    def __init__(
        self,
        config: LLMConfig,
        engine: Engine,
        lifecycle: StreamLifecycle,
        prompts: PromptBuilder,
        info: ModelInfo,
        custom: ZeroShotVoices | None = None,
        loras: LoraVoices | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self._config = config
        self._engine = engine
        self._life = lifecycle
        self._prompts = prompts
        self._info = info
        self._tags = frozenset(info.emotion_tags)
        self._custom = custom
        self._loras = loras
        self._tracing = tracing
        self._voices = VoiceLookup(
            info.voices,
            None if loras is None else (lambda v: loras.get(v) is not None),
            None if custom is None else custom.has,
        )
        """The voices this worker takes, looked up in the gateway's order (common.voice_lookup)."""

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
            s = self._life.streams.get(msg.stream_id)
            message = f"internal error: {type(e).__name__}: {e}"
            if s is not None:
                await self._life.fail(s, "internal_error", message, 500)
            elif isinstance(msg, LlmSubmit):
                self._life.reject(msg.stream_id, message, "internal_error", 500)

    async def advance(self, s: LlmStream) -> None:
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
                await self._life.fail(s, EMPTY_TEXT, "empty text: there is nothing to say", 400)
            else:
                self._life.finish(s)
            return

    # -- control messages ---------------------------------------------------------------

    async def _submit(self, msg: LlmSubmit) -> None:
        if msg.stream_id in self._life.streams:
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
            self._life.reject(msg.stream_id, str(e), e.code)
            return
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
        s = self._life.open(msg.stream_id, plan, pieces, budgets, text, prefix, lora, speaker)
        if self._tracing is not None and msg.traceparent:
            self._trace(s, msg)
        await self.advance(s)

    def _trace(self, s: LlmStream, msg: LlmSubmit) -> None:
        """Open the stream's spans and queue its START record for the codec worker."""
        assert self._tracing is not None
        attributes = {
            "orpheus.stream_id": f"{s.stream_id:#x}", "orpheus.voice": msg.voice,
            "orpheus.voice_kind": s.plan.kind, "orpheus.text_chars": len(msg.text),
            "orpheus.text_open": msg.text_open,
        }  # fmt: skip
        s.span = self._tracing.start("llm.stream", msg.traceparent, attributes=attributes)
        s.prefill = self._tracing.start("llm.prefill", parent=s.span)
        self._life.queue_start(s)

    async def _append(self, msg: LlmAppendText) -> None:
        s = self._life.streams.get(msg.stream_id)
        if s is None or s.done:
            return  # finished or cancelled already: nothing to do
        if s.text is None:
            log.warning("AppendText for stream %#x whose text is closed: ignored", s.stream_id)
            return
        s.pieces.extend(s.text.feed(msg.text))
        if msg.final:
            s.pieces.extend(s.text.close())
            s.text = None
        await self.advance(s)

    async def _cancel(self, msg: LlmCancel) -> None:
        s = self._life.streams.get(msg.stream_id)
        if s is None or s.done:
            return
        if s.span is not None:
            s.span.add_event("cancelled", {"orpheus.reason": msg.reason})
        await self._life.stop_request(s, "cancelled")
        s.reason = "cancelled"
        self._life.finish(s)
        log.debug("stream %#x cancelled: %s", s.stream_id, msg.reason)

    # -- segments -----------------------------------------------------------------------

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
                stop_id=self._engine.space.end_of_speech,
            )
        except BadRequest as e:
            await self._life.fail(s, e.code, str(e), 400)
            return
        rid = f"{s.stream_id:x}-{s.segment}"
        self._life.new_segment(s)
        try:
            collector = await self._engine.add(rid, prompt, params, s.lora)
        except EngineDeadError:
            raise
        except ValueError as e:  # vLLM's validation errors are ValueErrors
            await self._life.fail(s, "bad_request", f"rejected by the engine: {e}", 400)
            return
        except Exception as e:
            log.exception("stream %#x: add_request failed", s.stream_id)
            await self._life.fail(s, "engine_error", f"{type(e).__name__}: {e}", 500)
            return
        M.SEGMENTS.inc()
        if s.span is not None:
            s.span.add_event(
                "segment", {"orpheus.segment": s.segment, "orpheus.prompt_tokens": len(prompt)}
            )
        if s.done:  # cancelled or failed while the request was being added
            await self._engine.abort(rid)
            return
        self._life.segment_live(s, rid, collector)
