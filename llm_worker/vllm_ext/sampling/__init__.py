"""Sampling for Orpheus on vLLM: tensor-based repetition penalty and the audio-token constraint.

Entry point: ``plan`` (``SamplingPlan``: which path the worker runs, decided once at start;
``plan.sampling_kwargs``: a request's sampling as ``SamplingParams`` keywords, built once).
Prevented-token counts reach the worker through a ``PreventedBoard`` (``counters``).

- ``runner``: which vLLM model runner (V1 or V2), chosen and pinned before the engine starts
- ``penalty``: the repetition penalty in preallocated tensors (V1); ``rows``, ``staging``:
  the V1 processors' row bookkeeping and the host vectors they fill each step
- ``constraint`` (V1), ``constraint_v2`` (V2), ``audio_mask``: the audio-token constraint
  and its batched tensor ops
- ``args``: the per-request arguments of the processors (``SamplingParams.extra_args``)
- ``hooks``: the per-stream side the llm service calls
"""

from llm_worker.vllm_ext.sampling.args import EXTRA_ARGS_KEY, RequestArgs
from llm_worker.vllm_ext.sampling.counters import Counter, CounterSlots, PreventedBoard
from llm_worker.vllm_ext.sampling.hooks import PlanHooks, SamplingHooks
from llm_worker.vllm_ext.sampling.plan import SamplingPlan, detect_model_runner, sampling_kwargs
from llm_worker.vllm_ext.sampling.runner import (
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
    "sampling_kwargs",
]
