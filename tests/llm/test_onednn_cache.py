"""oneDNN's primitive cache in vLLM's CPU processes: capped through the environment they
inherit, an operator's own setting kept."""

from __future__ import annotations

import pytest

from common.config.llm import LLMConfig
from llm_worker.engine_env import ONEDNN_CACHE_ENV, bound_onednn_cache


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
