"""The sampling package's per-stream side, as the llm service needs it.

A stream takes a slot on the prevented-token board when it starts (``acquire``), passes the
sampling arguments that switch the package's processors on to each of its segments' vLLM
requests (``kwargs``), and gives the slot back when it ends (``release``, which returns how
many invalid audio tokens the constraint prevented for it).

:class:`SamplingHooks` is the default: vLLM's own repetition penalty, no constraint, no
board. :class:`PlanHooks` is the one the worker runs: a :class:`SamplingPlan`'s request
arguments and, with the constraint on, the board's :class:`CounterSlots`
(:mod:`llm_worker.sampling_setup` builds it).
"""

from __future__ import annotations

from typing import Any


class SamplingHooks:
    """The default: vLLM's own repetition penalty and no constraint."""

    def acquire(self) -> Any:
        """The new stream's slot on the prevented-token board (None: it has none)."""
        return None

    def kwargs(self, repetition_penalty: float, counter: Any) -> dict[str, Any] | None:
        """``SamplingParams`` keywords for the stream's requests (None: vLLM's penalty)."""
        return None

    def release(self, counter: Any) -> int:
        """Give the slot back; returns the invalid tokens prevented for its stream."""
        return 0


class PlanHooks(SamplingHooks):
    """A :class:`~llm_worker.vllm_ext.sampling.plan.SamplingPlan`'s arguments, and the board's slots
    (:class:`~llm_worker.vllm_ext.sampling.counters.CounterSlots`; None without the constraint)."""

    def __init__(self, plan: Any, slots: Any) -> None:
        self._plan = plan
        self._slots = slots

    def acquire(self) -> Any:
        return self._slots.acquire() if self._slots is not None else None

    def kwargs(self, repetition_penalty: float, counter: Any) -> dict[str, Any] | None:
        return self._plan.request_kwargs(repetition_penalty=repetition_penalty, counter=counter)

    def release(self, counter: Any) -> int:
        return self._slots.release(counter) if self._slots is not None else 0
