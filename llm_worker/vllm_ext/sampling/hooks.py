"""The sampling package's per-stream side, as the llm service needs it.

A stream takes a slot on the prevented-token board when it starts (``acquire``), builds its
requests' sampling keywords once from its resolved sampling (``kwargs``, through
:func:`~llm_worker.vllm_ext.sampling.plan.sampling_kwargs`), and gives the slot back when it
ends (``release``, which returns how many invalid audio tokens the constraint prevented for
it).

:class:`SamplingHooks` is the default: vLLM's own repetition penalty, no constraint, no
board. :class:`PlanHooks` is the one the worker runs: a :class:`SamplingPlan`'s request
arguments and, with the constraint on, the board's :class:`CounterSlots`
(:mod:`llm_worker.engine.sampling_setup` builds it).
"""

from __future__ import annotations

from typing import Any

from common.config.llm import VoiceSampling
from llm_worker.vllm_ext.sampling.plan import sampling_kwargs


class SamplingHooks:
    """The default: vLLM's own repetition penalty and no constraint."""

    def acquire(self) -> Any:
        """The new stream's slot on the prevented-token board (None: it has none)."""
        return None

    def kwargs(self, sampling: VoiceSampling, counter: Any) -> dict[str, Any]:
        """The ``SamplingParams`` sampling keywords of the stream's requests."""
        return sampling_kwargs(sampling)

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

    def kwargs(self, sampling: VoiceSampling, counter: Any) -> dict[str, Any]:
        return sampling_kwargs(sampling, self._plan, counter)

    def release(self, counter: Any) -> int:
        return self._slots.release(counter) if self._slots is not None else 0
