"""How the worker learns that an engine step's outputs are all delivered.

The service maps and publishes a step's tokens once every request's output of that step
is in its collector. Which hook tells it depends on ``llm.engine_stats``:

- on (vLLM's stats and its ``vllm:*`` Prometheus metrics kept): :class:`StepHook` is one
  more stat logger, whose ``record`` vLLM's output handler calls once per step after it
  delivered the step's outputs;
- off (``disable_log_stats``: no per-request, per-step statistics in the engine core or the
  output processor, no ``vllm:*`` metrics; a custom stat logger would turn them back on):
  :class:`OutputLoopHook` is called each time the output handler asks the engine core for
  the next step's outputs, which it does right after delivering the previous step's, at the
  same point of its loop.

Both call a :class:`StepRelay`, whose listener (the service's) may be set after the engine
exists.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from vllm.config import VllmConfig
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats


class StepHook(StatLoggerBase):
    """A stat logger that only signals: "this engine step's outputs are all delivered"."""

    def __init__(
        self, vllm_config: VllmConfig, engine_index: int = 0, *, on_step: Callable[[], None]
    ) -> None:
        self._on_step = on_step

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        self._on_step()

    def log_engine_initialized(self) -> None:
        pass


class OutputLoopHook:
    """With vLLM's stats off: "this engine step's outputs are all delivered", from the output
    handler's loop.

    ``AsyncLLM``'s output handler is one loop: ``await engine_core.get_output_async()`` (one
    step's ``EngineCoreOutputs``), hand every output to its request's collector (in chunks,
    yielding between them), record stats, and back to the top. Wrapping the client's
    ``get_output_async`` calls ``on_step`` at the top of each pass, i.e. after the previous
    step was delivered, the moment :class:`StepHook` is called with stats on. Installed
    before the first request (the loop starts with it) and on the instance only;
    tests/llm/test_vllm_source_compat.py checks the loop in every supported vLLM.
    """

    __slots__ = ("_fetch", "_on_step")

    def __init__(self, fetch: Callable[[], Awaitable[Any]], on_step: Callable[[], None]) -> None:
        self._fetch = fetch
        self._on_step = on_step

    @classmethod
    def install(cls, llm: AsyncLLM, on_step: Callable[[], None]) -> None:
        client = llm.engine_core
        client.get_output_async = cls(client.get_output_async, on_step)  # type: ignore[method-assign]

    async def __call__(self) -> Any:
        self._on_step()
        return await self._fetch()


class StepRelay:
    """The step hook's callback: the listener may be set after the engine exists."""

    __slots__ = ("listener",)

    def __init__(self) -> None:
        self.listener: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.listener is not None:
            self.listener()
