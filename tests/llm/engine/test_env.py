"""What the llm worker hands vLLM's CPU processes through their environment: oneDNN's primitive
cache capped, the model worker in the engine core's process; an operator's own setting kept."""

from __future__ import annotations

import pytest

from common.config.llm import LLMConfig
from llm_worker.engine.env import (
    MULTIPROCESSING_ENV,
    ONEDNN_CACHE_ENV,
    bound_onednn_cache,
    worker_in_engine_core,
)


def test_the_cap_goes_into_the_environment_vllm_hands_down() -> None:
    env: dict[str, str] = {}
    note = bound_onednn_cache(LLMConfig().cpu_onednn_cache, env)
    assert env == {ONEDNN_CACHE_ENV: "64"}
    assert note == f"oneDNN keeps at most 64 primitives per vLLM process ({ONEDNN_CACHE_ENV})"


def test_an_operators_setting_wins_and_a_negative_cap_is_an_error() -> None:
    env = {ONEDNN_CACHE_ENV: "4096"}
    assert bound_onednn_cache(64, env) is None and env[ONEDNN_CACHE_ENV] == "4096"
    with pytest.raises(ValueError, match=r"llm\.cpu_onednn_cache must be >= 0, not -1"):
        bound_onednn_cache(-1, {})


def test_vllms_model_worker_runs_in_its_engine_core_unless_the_operator_says() -> None:
    env: dict[str, str] = {}
    assert worker_in_engine_core(env) is not None and env == {MULTIPROCESSING_ENV: "0"}
    for theirs in ("1", "0"):
        env = {MULTIPROCESSING_ENV: theirs}
        assert worker_in_engine_core(env) is None and env == {MULTIPROCESSING_ENV: theirs}
