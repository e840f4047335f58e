"""Model-runner choice and the environment vLLM's samplers need on the GPU machine."""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

from common.config.llm import LLMConfig
from llm_worker.vllm_ext.sampling import (
    ModelRunner,
    SamplingPlan,
    choose_model_runner,
    pin_model_runner,
    prepare_sampler_environment,
)
from llm_worker.vllm_ext.sampling import runner as runner_mod
from llm_worker.vllm_ext.sampling.constraint import AudioTokenConstraint
from llm_worker.vllm_ext.sampling.penalty import TensorRepetitionPenalty
from llm_worker.vllm_ext.sampling.staging import Staged


def test_auto_is_v1_with_our_processors_on_cpu() -> None:
    choice = choose_model_runner("auto", "cpu")
    assert choice.runner is ModelRunner.V1
    plan = SamplingPlan.for_config(LLMConfig(), choice.runner, v2_processors=choice.v2_processors)
    assert plan.logits_processors() == [TensorRepetitionPenalty, AudioTokenConstraint]


def test_auto_is_v2_where_v2_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # The H100 measurement behind the default: V2 held 78 streams, V1 with ours 45.
    monkeypatch.setattr(runner_mod, "v2_available", lambda device: True)
    assert choose_model_runner("auto", "cuda").runner is ModelRunner.V2


def test_v2_is_refused_where_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="GPU build"):
        choose_model_runner("v2", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        choose_model_runner("v3", "cuda")


def test_v2_on_a_vllm_without_v2_processors_runs_no_custom_processor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # vLLM 0.25 (the GPU machine's): V2 falls back to V1 whenever any custom logits
    # processor is configured, and its V2 processor interface does not exist. The plan
    # must then ask for none (the defect: it imported constraint_v2 and crashed at start).
    monkeypatch.setattr(runner_mod, "v2_available", lambda device: True)
    monkeypatch.setattr(runner_mod, "v2_processors_supported", lambda: False)
    choice = choose_model_runner("v2", "cuda")
    assert choice.runner is ModelRunner.V2 and not choice.v2_processors
    assert "constraint off" in choice.reason
    plan = SamplingPlan.for_config(LLMConfig(), choice.runner, v2_processors=False)
    assert plan.logits_processors() == []
    assert not plan.tensor_penalty and not plan.constrain_audio
    assert plan.request_kwargs(repetition_penalty=1.1) == {"repetition_penalty": 1.1}


def test_v2_processor_interface_matches_the_installed_vllm() -> None:
    try:
        importlib.import_module(runner_mod.V2_PROCESSOR_INTERFACE)
        has = True
    except ModuleNotFoundError:  # vLLM 0.25: not even its parent package exists
        has = False
    assert runner_mod.v2_processors_supported() is has
    if has:  # 0.32+: the V2 constraint imports against it
        from llm_worker.vllm_ext.sampling.constraint_v2 import AudioTokenConstraintV2

        plan = SamplingPlan.for_config(LLMConfig(), ModelRunner.V2, v2_processors=True)
        assert plan.logits_processors() == [AudioTokenConstraintV2]


def test_pin_sets_and_guards_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    pin_model_runner(ModelRunner.V1)
    import os

    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    from vllm import envs

    assert envs.VLLM_USE_V2_MODEL_RUNNER is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match="contradicts"):
        pin_model_runner(ModelRunner.V1)


def test_flashinfer_sampler_is_off_without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        runner_mod.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flashinfer" else real(name, *a),
    )
    assert prepare_sampler_environment() is not None
    import os

    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert prepare_sampler_environment() is None  # an explicit setting is left alone


def _cuda_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vLLM's CUDA platform answers on an H100, patched into the sampler's module."""
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.sample.ops import topk_topp_sampler as tts

    monkeypatch.setattr(tts.current_platform, "is_cuda", lambda: True, raising=False)
    monkeypatch.setattr(
        tts.current_platform,
        "get_device_capability",
        lambda device_id=0: DeviceCapability(9, 0),
        raising=False,
    )


@pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is not None, reason="flashinfer is installed here"
)
def test_vllms_gpu_sampler_builds_without_flashinfer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine-core crash of the first GPU start: V1's Sampler on CUDA imports flashinfer."""
    from vllm.v1.sample.sampler import Sampler

    _cuda_answers(monkeypatch)
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    with pytest.raises(ImportError):  # the defect, reproduced
        Sampler()
    prepare_sampler_environment()
    sampler = Sampler()
    assert sampler.topk_topp_sampler.forward == sampler.topk_topp_sampler.forward_native


def test_staged_upload_reads_the_state_as_of_the_call() -> None:
    s = Staged(8, torch.int64, torch.device("cpu"))
    s.np[:] = range(8)
    assert s.upload(5).tolist() == [0, 1, 2, 3, 4]
    s.np[2] = 20
    assert s.upload(3).tolist() == [0, 1, 20]
