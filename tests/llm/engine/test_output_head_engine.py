"""The audio-only output head inside the real vLLM CPU engine, with the tiny Orpheus model.

Two engines on the same weights, the checkpoint's head and the audio head (vLLM's CPU start-up
is slow: one of each for the module). The head must be exact: the logits of the emittable ids
are the full head's, and greedy generation through the worker's own sampling plan (tensor
repetition penalty and audio-token constraint on the V1 runner) is identical.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from offline_engine import offline_llm
from safetensors.torch import load_file
from vllm import LLM, SamplingParams

from common.config.llm import LLMConfig
from llm_worker.engine.args import GENERATION_CONFIG
from llm_worker.engine.output_head import HeadChoice, choose_output_head
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.sampling import (
    ModelRunner,
    SamplingPlan,
    choose_model_runner,
    pin_model_runner,
)
from llm_worker.vllm_ext.token_space import HeadKind, TokenSpace
from testkit.tiny_model import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.engine]

STREAMS = 4
TOKENS = 5 * 7
HIDDEN_ROWS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    write_tiny_model(path)
    return path


@pytest.fixture(scope="module")
def plan() -> SamplingPlan:
    choice = choose_model_runner("auto", "cpu")
    assert choice.runner is ModelRunner.V1  # the CPU build
    pin_model_runner(choice.runner)
    return SamplingPlan.for_config(LLMConfig(), choice.runner)


def build(model: Path, plan: SamplingPlan, head: HeadChoice) -> LLM:
    # apply_model ships a function to the engine core process (pickled by value).
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    overrides = head.hf_overrides()
    return offline_llm(
        model=str(model),
        dtype="float32",
        max_model_len=256,
        max_num_seqs=STREAMS,
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        seed=0,
        skip_tokenizer_init=True,
        generation_config=GENERATION_CONFIG,  # as the worker (llm_worker/engine/engine.py says why)
        logits_processors=plan.logits_processors(),
        **({"hf_overrides": overrides} if overrides else {}),
    )


@pytest.fixture(scope="module")
def heads(model: Path, plan: SamplingPlan) -> Iterator[dict[HeadKind, LLM]]:
    out: dict[HeadKind, LLM] = {}
    for setting in ("full", "audio"):
        head = choose_output_head(setting, str(model), v1_runner=True, tensor_penalty=True)
        out[head.space.kind] = build(model, plan, head)
    yield out
    out.clear()


def compute_logits(hidden: torch.Tensor, m: torch.nn.Module) -> torch.Tensor:
    """Runs in the engine's worker (``apply_model``)."""
    dtype = next(m.parameters()).dtype
    return m.compute_logits(hidden.to(dtype)).float().cpu()  # type: ignore[operator]


def logits_of(llm: LLM, hidden: torch.Tensor) -> torch.Tensor:
    return llm.apply_model(partial(compute_logits, hidden))[0]


def test_audio_head_logits_are_the_full_heads_emittable_columns(
    heads: dict[HeadKind, LLM], model: Path
) -> None:
    embed = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"].float()
    hidden = torch.randn(HIDDEN_ROWS, embed.shape[1], generator=torch.Generator().manual_seed(0))
    full = logits_of(heads[HeadKind.FULL], hidden)
    audio = logits_of(heads[HeadKind.AUDIO], hidden)
    width = TokenSpace.audio(T.VOCAB_SIZE).width
    assert full.shape == (HIDDEN_ROWS, T.VOCAB_SIZE)
    assert audio.shape == (HIDDEN_ROWS, width)
    # The same dot products (engine column r is checkpoint id 128256 + r).
    torch.testing.assert_close(audio, full[:, T.CUSTOM_TOKEN_BASE :], rtol=1e-5, atol=1e-5)
    # ... and they are the checkpoint's own rows, not some rotation of them.
    ref = hidden @ embed[T.CUSTOM_TOKEN_BASE :].T
    torch.testing.assert_close(audio, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(audio.argmax(1), full[:, T.CUSTOM_TOKEN_BASE :].argmax(1))


def prompts() -> list[list[int]]:
    out = []
    for i in range(STREAMS):
        text = [T.BOS, *range(300 + 7 * i, 300 + 7 * i + 3 + i)]
        out.append([*T.PROMPT_PREFIX, *text, *T.PROMPT_SUFFIX])
    return out


def greedy(llm: LLM, plan: SamplingPlan, space: TokenSpace) -> list[list[int]]:
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=TOKENS,
            min_tokens=7 * (1 + i),
            stop_token_ids=[space.end_of_speech],
            detokenize=False,
            **plan.request_kwargs(repetition_penalty=1.3),
        )
        for i in range(STREAMS)
    ]
    inputs = [{"prompt_token_ids": space.to_engine(p)} for p in prompts()]
    outs = llm.generate(inputs, params, use_tqdm=False)
    return [
        space.from_engine_(np.asarray(o.outputs[0].token_ids, dtype=np.int64)).tolist()
        for o in outs
    ]


def test_greedy_generation_is_identical_with_the_audio_head(
    heads: dict[HeadKind, LLM], plan: SamplingPlan
) -> None:
    full = greedy(heads[HeadKind.FULL], plan, TokenSpace.full())
    audio = greedy(heads[HeadKind.AUDIO], plan, TokenSpace.audio(T.VOCAB_SIZE))
    assert audio == full
    assert all(len(ids) >= 7 for ids in full)
    emitted = {t for ids in full for t in ids}
    assert all(t == T.END_OF_SPEECH or T.AUDIO_TOKEN_BASE <= t < T.AUDIO_TOKEN_END for t in emitted)
