"""The sampling plan: which processors, which request arguments, on each model runner."""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from common.config.llm import LLMConfig
from llm_worker.vllm_ext.sampling import Counter, ModelRunner, RequestArgs, SamplingPlan
from llm_worker.vllm_ext.sampling.constraint import AudioTokenConstraint
from llm_worker.vllm_ext.sampling.penalty import TensorRepetitionPenalty
from llm_worker.vllm_ext.sampling.runner import v2_processors_supported


def test_v1_uses_our_penalty_and_skips_vllms() -> None:
    plan = SamplingPlan.for_config(LLMConfig(), ModelRunner.V1, board="orpheus-1-prevented")
    assert plan.logits_processors() == [TensorRepetitionPenalty, AudioTokenConstraint]
    kw = plan.request_kwargs(repetition_penalty=1.1, counter=Counter(slot=7, baseline=0))
    params = SamplingParams(**kw)
    assert params.repetition_penalty == 1.0  # vLLM's list path stays off
    assert RequestArgs.of(params) == RequestArgs(
        repetition_penalty=1.1, constrain_audio=True, board="orpheus-1-prevented", slot=7
    )
    assert "orpheus tensor penalty" in plan.describe()


@pytest.mark.skipif(
    not v2_processors_supported(), reason="this vLLM's V2 runner takes no custom processors"
)
def test_v2_uses_vllms_device_penalty() -> None:
    from llm_worker.vllm_ext.sampling.constraint_v2 import AudioTokenConstraintV2

    plan = SamplingPlan.for_config(LLMConfig(), ModelRunner.V2)
    assert plan.logits_processors() == [AudioTokenConstraintV2]
    kw = plan.request_kwargs(repetition_penalty=1.1)
    assert kw["repetition_penalty"] == 1.1
    assert RequestArgs.of(SamplingParams(**kw)) == RequestArgs(constrain_audio=True)
    assert "vLLM built-in" in plan.describe() and "V2" in plan.describe()


def test_switches_off() -> None:
    cfg = LLMConfig(tensor_penalties=False, constrain_audio_tokens=False)
    plan = SamplingPlan.for_config(cfg, ModelRunner.V1, board="b")
    assert plan.logits_processors() == []
    assert plan.request_kwargs(repetition_penalty=1.3) == {"repetition_penalty": 1.3}
    on = SamplingPlan.for_config(LLMConfig(), ModelRunner.V1)
    assert RequestArgs.of(SamplingParams(**on.request_kwargs(repetition_penalty=1.0))) == (
        RequestArgs(constrain_audio=True)
    )
    assert on.request_kwargs(repetition_penalty=1.0, constrain=False) == {"repetition_penalty": 1.0}


@pytest.mark.parametrize(
    "extra",
    [
        {"orpheus": {"repetition_penalty": 0.0}},
        {"orpheus": {"repetition_penalty": "1.1"}},
        {"orpheus": {"slot": -1}},
        {"orpheus": {"board": 3}},
        {"orpheus": {"typo": 1}},
        {"orpheus": [1.1]},
    ],
)
def test_malformed_arguments_are_rejected(extra: dict) -> None:
    with pytest.raises(ValueError):
        TensorRepetitionPenalty.validate_params(SamplingParams(extra_args=extra))


def test_penalty_applied_twice_is_rejected() -> None:
    params = SamplingParams(
        repetition_penalty=1.1, extra_args={"orpheus": {"repetition_penalty": 1.1}}
    )
    with pytest.raises(ValueError, match="twice"):
        AudioTokenConstraint.validate_params(params)
