"""Sampling for Orpheus on vLLM: tensor-based repetition penalty and the audio-token constraint.

Entry point: :class:`SamplingPlan` (see :mod:`llm_worker.sampling.plan` for usage).
Prevented-token counts reach the worker through a :class:`PreventedBoard`.
"""

from llm_worker.sampling.args import EXTRA_ARGS_KEY, RequestArgs
from llm_worker.sampling.counters import Counter, CounterSlots, PreventedBoard
from llm_worker.sampling.hooks import PlanHooks, SamplingHooks
from llm_worker.sampling.plan import SamplingPlan, detect_model_runner
from llm_worker.sampling.runner import (
    ModelRunner,
    RunnerChoice,
    choose_model_runner,
    pin_model_runner,
    prepare_sampler_environment,
)

__all__ = [
    "EXTRA_ARGS_KEY",
    "Counter",
    "CounterSlots",
    "ModelRunner",
    "PlanHooks",
    "PreventedBoard",
    "RequestArgs",
    "RunnerChoice",
    "SamplingHooks",
    "SamplingPlan",
    "choose_model_runner",
    "detect_model_runner",
    "pin_model_runner",
    "prepare_sampler_environment",
]
