"""A stream of the llm worker as its rooms share it: its state (:class:`LlmStream`), and what
the rooms need of the engine (the :class:`Engine` protocol, which
:class:`llm_worker.engine.engine.GenerationEngine` meets and the unit tests fake)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from llm_worker.requests import RequestPlan
from llm_worker.text import TextStream
from llm_worker.vllm_ext.token_space import TokenSpace

if TYPE_CHECKING:
    from opentelemetry.trace import Span
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest


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
    """:class:`llm_worker.engine.engine.GenerationEngine`, as the worker's rooms use it."""

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


@dataclass(slots=True, frozen=True)
class Orphan:
    """The addressee of a record for a request that never became a stream."""

    stream_id: int
    frames: int = 0
