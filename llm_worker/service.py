"""The llm_worker's service: streams, their vLLM requests, and one code-ring publish per step.

Life of a stream::

    LlmSubmit ──validate──► pieces of text ──► segment 0 (vLLM request) ──► segment 1 ──► ... END
      │ bad input: ERROR 400, no engine work          each engine step: CODES records
      └ LlmCancel at any time: abort the request, END(reason="cancelled")

Frame ``seq`` counts the stream's frames across all of its segments, so long text comes
out as one continuous stream.

Three rooms, as vLLM splits ``AsyncLLM``'s intake from its output processor:

- :class:`llm_worker.intake.Intake` takes the control messages in and starts each
  segment's request;
- :class:`llm_worker.publisher.StepPublisher`, the *pump*, is the only writer of the code
  ring: one publish per engine step, then the endings the step caused;
- :class:`llm_worker.lifecycle.StreamLifecycle` is the one owner of a stream's life (open,
  each segment live and ended, aborted, closed with exactly one END or ERROR), used by both.

This module wires them and runs the pump after each engine step.

Tracing (``common.tracing``, when on and the ``LlmSubmit`` carries a ``traceparent``): a
stream is one ``llm.stream`` span (voice, segments as events, tokens, frames, its outcome,
cancellation), with a child ``llm.prefill`` span from the submit to the first sampled token
(the engine's queue and the prefill). Its context goes to the codec worker in the ``START``
record. No per-token work: the first token is one test per stream and step.

The service sees the engine through :class:`llm_worker.stream.Engine` (``add``/``abort`` and
the output collectors of :mod:`llm_worker.engine.engine`) and the ring through a
:class:`llm_worker.output.RecordSink`, so that unit tests drive it with fakes of both.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from common.config.llm import LLMConfig
from llm_worker.intake import Intake
from llm_worker.lifecycle import StreamLifecycle
from llm_worker.model_info import ModelInfo
from llm_worker.output import RecordSink
from llm_worker.prompt import PromptBuilder
from llm_worker.publisher import StepPublisher
from llm_worker.stream import Engine
from llm_worker.vllm_ext.sampling.hooks import SamplingHooks
from llm_worker.voices.custom import ZeroShotVoices
from shm.messages import LlmControl

if TYPE_CHECKING:
    from common.tracing import Tracing
    from llm_worker.voices.lora import LoraVoices


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
        self._sink = sink
        self._wake = asyncio.Event()
        self._life = StreamLifecycle(
            engine, sampling or SamplingHooks(), config.repetition_guard_frames, self._wake.set
        )
        self._intake = Intake(config, engine, self._life, prompts, info, custom, loras, tracing)
        self._publisher = StepPublisher(
            self._life, sink, engine.space, self._intake.advance, self._wake.set, tracing
        )

    @property
    def active_streams(self) -> int:
        return len(self._life.streams)

    def on_step(self) -> None:
        """Called by the engine's step hook once a step's outputs are all delivered."""
        self._wake.set()

    async def handle(self, msg: LlmControl) -> None:
        """Apply one control message. A bug while handling it fails that stream only."""
        await self._intake.handle(msg)

    async def pump(self) -> None:
        """Publish what the engine delivered since the last call (:meth:`run` calls it after
        each engine step)."""
        await self._publisher.pump()

    async def run(self) -> None:
        """The pump: runs until cancelled; raises EngineDeadError if the engine dies."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._publisher.pump()

    async def shutdown(self, code: str = "shutdown", message: str = "the worker stopped") -> None:
        """Fail every stream (ERROR 503) and publish; the engine may already be gone."""
        for s in list(self._life.streams.values()):
            await self._life.fail(s, code, message, 503, abort=False)
        await self._publisher.flush_outbox()
        self._sink.publish()
