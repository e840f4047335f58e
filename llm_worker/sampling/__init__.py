"""Sampling for Orpheus on vLLM: tensor-based repetition penalty and the audio-token constraint.

Entry point: :class:`SamplingPlan` (see :mod:`llm_worker.sampling.plan` for usage).
Prevented-token counts reach the worker through a :class:`PreventedBoard`.
"""

from llm_worker.sampling.args import EXTRA_ARGS_KEY, RequestArgs
from llm_worker.sampling.counters import Counter, CounterSlots, PreventedBoard
from llm_worker.sampling.plan import ModelRunner, SamplingPlan, detect_model_runner

__all__ = [
    "EXTRA_ARGS_KEY",
    "Counter",
    "CounterSlots",
    "ModelRunner",
    "PreventedBoard",
    "RequestArgs",
    "SamplingPlan",
    "detect_model_runner",
]
