"""The output head's choice and its token space (no engine:
tests/llm/engine/test_output_head_engine.py runs the head in vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llm_worker.engine.output_head import choose_output_head
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.token_space import (
    AUDIO_HEAD_ARCHITECTURE,
    CheckpointLayoutError,
    HeadKind,
    TokenSpace,
)
from shm.records import CODEBOOK_SIZE, FRAME_CODES

AUDIO = TokenSpace.audio(T.VOCAB_SIZE)


def checkpoint(tmp_path: Path, **over: object) -> str:
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": T.VOCAB_SIZE}
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def test_the_emittable_ids_come_first() -> None:
    assert AUDIO.width == 28_684 and T.VOCAB_SIZE / AUDIO.width > 5.4
    assert AUDIO.engine_id(T.CUSTOM_TOKEN_BASE) == 0
    assert AUDIO.end_of_speech == 2 and AUDIO.start_of_speech == 1
    assert AUDIO.audio_token_base == 10
    last_audio = T.AUDIO_TOKEN_END - 1
    assert AUDIO.engine_id(last_audio) == 10 + FRAME_CODES * CODEBOOK_SIZE - 1 < AUDIO.width
    assert AUDIO.engine_id(0) == AUDIO.width, "text ids follow the emittable ones"
    assert AUDIO.engine_id(T.BOS) >= AUDIO.width


@given(st.lists(st.integers(0, T.VOCAB_SIZE - 1), max_size=64))
def test_to_engine_and_back_is_the_identity(ids: list[int]) -> None:
    for space in (AUDIO, TokenSpace.full()):
        engine = space.to_engine(ids)
        assert all(0 <= e < T.VOCAB_SIZE for e in engine)
        back = space.from_engine_(np.asarray(engine, dtype=np.int64))
        assert back.tolist() == ids


def test_full_head_is_the_identity() -> None:
    full = TokenSpace.full()
    assert full.offset == 0 and full.width == T.VOCAB_SIZE
    assert full.end_of_speech == T.END_OF_SPEECH and full.audio_token_base == T.AUDIO_TOKEN_BASE


def test_auto_takes_the_audio_head_where_it_is_supported(tmp_path: Path) -> None:
    model = checkpoint(tmp_path)
    choice = choose_output_head("auto", model, v1_runner=True, tensor_penalty=True)
    assert choice.space.kind is HeadKind.AUDIO
    assert choice.hf_overrides() == {"architectures": [AUDIO_HEAD_ARCHITECTURE]}
    assert "28,684 of 156,940" in choice.describe()
    full = choose_output_head("full", model, v1_runner=True, tensor_penalty=True)
    assert full.space.kind is HeadKind.FULL and full.hf_overrides() is None


def test_auto_falls_back_with_the_reason_and_audio_refuses(tmp_path: Path) -> None:
    model = checkpoint(tmp_path)
    # vLLM's own V1 penalty counts prompt ids over the logits' width.
    choice = choose_output_head("auto", model, v1_runner=True, tensor_penalty=False)
    assert choice.space.kind is HeadKind.FULL and "tensor_penalties" in choice.reason
    with pytest.raises(ValueError, match="tensor_penalties"):
        choose_output_head("audio", model, v1_runner=True, tensor_penalty=False)
    # The V2 runner's penalty reads its tables over the logits' width: fine.
    v2 = choose_output_head("audio", model, v1_runner=False, tensor_penalty=False)
    assert v2.space.kind is HeadKind.AUDIO
    other = checkpoint(tmp_path, architectures=["MistralForCausalLM"])
    assert choose_output_head("auto", other, v1_runner=False, tensor_penalty=False).space.kind is (
        HeadKind.FULL
    )
    with pytest.raises(ValueError, match="MistralForCausalLM"):
        choose_output_head("audio", other, v1_runner=False, tensor_penalty=False)
    with pytest.raises(ValueError, match="must be one of"):
        choose_output_head("tiny", model, v1_runner=False, tensor_penalty=False)


def test_without_the_plugin_auto_takes_the_full_head_and_audio_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM knows the model class only through the entry point (every process it starts
    loads it): not installed, or filtered out by VLLM_PLUGINS, is found before the engine."""
    model = checkpoint(tmp_path)
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    choice = choose_output_head("auto", model, v1_runner=False, tensor_penalty=False)
    assert choice.space.kind is HeadKind.FULL and "VLLM_PLUGINS" in choice.reason
    with pytest.raises(ValueError, match="does not name orpheus_serve"):
        choose_output_head("audio", model, v1_runner=False, tensor_penalty=False)
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin, orpheus_serve")
    assert choose_output_head("audio", model, v1_runner=False, tensor_penalty=False)
    monkeypatch.delenv("VLLM_PLUGINS")
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: [])
    choice = choose_output_head("auto", model, v1_runner=False, tensor_penalty=False)
    assert choice.space.kind is HeadKind.FULL and "entry point is not installed" in choice.reason


def test_a_checkpoint_without_audio_ids_is_refused_in_one_line(tmp_path: Path) -> None:
    model = checkpoint(tmp_path, vocab_size=128_256)
    for setting in ("auto", "audio", "full"):
        with pytest.raises(CheckpointLayoutError, match="not an Orpheus checkpoint") as e:
            choose_output_head(setting, model, v1_runner=True, tensor_penalty=True)
        assert "\n" not in str(e.value)
