"""The running vLLM engine: one persistent ``AsyncLLM`` fed token ids, and its step hook.

:class:`GenerationEngine` is what the service (:mod:`llm_worker.service`) talks to: it owns
the ``AsyncLLM`` and offers ``add`` (prompt token ids in, the request's output collector
out), ``abort``, and ``on_step`` (the step hook's listener, :mod:`llm_worker.engine.step_hooks`).
A fake with the same three members drives the service in unit tests without vLLM's engine.

The engine is built from its plan (:mod:`llm_worker.engine.plan`: model runner, processors,
output head) and its arguments (:mod:`llm_worker.engine.args`). With the audio output head
(``llm.output_head``, :mod:`llm_worker.engine.output_head`) the engine's token ids are the
checkpoint's rotated: :meth:`GenerationEngine.add` converts prompts, and
:attr:`GenerationEngine.space` tells the service how to read sampled ids.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from vllm import SamplingParams
from vllm.config import ProfilerConfig, VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.inputs.engine import tokens_input
from vllm.lora.request import LoRARequest
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.output_processor import RequestOutputCollector

from common.config.llm import LLMConfig
from llm_worker.engine.args import prepare_engine_args
from llm_worker.engine.step_hooks import OutputLoopHook, StepHook, StepRelay
from llm_worker.vllm_ext.token_space import TokenSpace

if TYPE_CHECKING:
    from llm_worker.engine.plan import EnginePlan


def start_engine(args: AsyncEngineArgs, on_step: Callable[[], None]) -> AsyncLLM:
    """Build the engine from ``args`` (blocking: loads the model), ``on_step`` called once per
    step by the hook that goes with its stats switch. Call from the event loop's thread."""
    if args.disable_log_stats:
        llm = AsyncLLM.from_engine_args(args)
        OutputLoopHook.install(llm, on_step)
        return llm

    def hook(vllm_config: VllmConfig, engine_index: int) -> StepHook:
        return StepHook(vllm_config, engine_index, on_step=on_step)

    return AsyncLLM.from_engine_args(args, stat_loggers=[hook])


class GenerationEngine:
    """Owns the ``AsyncLLM``: requests of prompt token ids, their output collectors, and the
    listener of its steps (see the module docstring)."""

    def __init__(
        self, llm: AsyncLLM, relay: StepRelay | None = None, space: TokenSpace | None = None
    ) -> None:
        self.llm = llm
        """The engine itself (warm-up, LoRA adapters, profiling, stats, shutdown)."""
        self._relay = relay or StepRelay()
        self.space = space or TokenSpace.full()
        """The engine's token ids (the output head's): sampled ids are engine ids."""

    @classmethod
    def start(
        cls,
        config: LLMConfig,
        device: str,
        plan: EnginePlan,
        profiler: ProfilerConfig | None = None,
    ) -> GenerationEngine:
        """Build the engine ``plan`` says (its processors and output head; blocking: loads
        the model), and check vLLM runs the model runner it was made for. Call from the
        event loop's thread."""
        relay = StepRelay()
        llm = start_engine(prepare_engine_args(config, device, plan, profiler), relay)
        try:
            plan.check_runner(llm.vllm_config)
        except BaseException:
            llm.shutdown()
            raise
        return cls(llm, relay, plan.head.space)

    def on_step(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener`` once per engine step, after every request's output of that step
        was delivered to its collector (None: nobody listens)."""
        self._relay.listener = listener

    async def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        lora: LoRARequest | None = None,
    ) -> RequestOutputCollector:
        """Start a request: the one way into the engine (the service's segments, the
        warm-up, ``bench engine``). No tokenizer: ``prompt`` is the checkpoint's token ids,
        converted here, once, to the engine's; ``params`` name engine ids (:attr:`space`:
        ``segment_params`` takes its ``end_of_speech``). Its outputs arrive in the returned
        collector (DELTA: new engine ids only, merged if not read in time). vLLM's
        validation errors are ValueErrors; EngineDeadError if the engine is gone."""
        ids = self.space.to_engine(prompt)
        return await self.llm.add_request(request_id, tokens_input(ids), params, lora_request=lora)

    async def run(self, request_id: str, prompt: list[int], params: SamplingParams) -> int:
        """:meth:`add` a request and read it to its end; returns the tokens it generated."""
        collector = await self.add(request_id, prompt, params)
        tokens = 0
        while True:
            out = await collector.get()
            tokens += sum(len(c.token_ids) for c in out.outputs)
            if out.finished:
                return tokens

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)
