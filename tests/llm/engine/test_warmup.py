"""The warm-up before ready (llm_worker/engine/warmup.py): every batch size up to the rows above
vLLM's top-p kernel thresholds, with the configured voices' sampling and the head's ids.
The worker process test (tests/llm/test_worker_process.py) checks it ran before WorkerReady."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.config.llm import LLMConfig, VoiceSampling
from llm_worker.engine.warmup import WARMUP_ROWS, warm_up, warmup_lengths, warmup_samplings
from llm_worker.prompt import PromptBuilder
from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.sampling.hooks import SamplingHooks
from llm_worker.vllm_ext.token_space import TokenSpace
from testkit.tiny_model import write_tiny_model


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> PromptBuilder:
    d = tmp_path_factory.mktemp("tiny")
    write_tiny_model(d)
    return PromptBuilder.from_pretrained(str(d))


class FakeEngine:
    """``GenerationEngine.run``'s shape: one token per step; every request in flight steps
    together, so the largest batch is the most requests in flight at once. ``prompts`` are
    what the engine's one entry converts (``space.to_engine``)."""

    def __init__(self, space: TokenSpace) -> None:
        self.space = space
        self.in_flight = 0
        self.batches: list[int] = []
        self.params: list[Any] = []
        self.prompts: list[list[int]] = []

    async def run(self, request_id: str, prompt: list[int], params: Any) -> int:
        self.params.append(params)
        self.prompts.append(self.space.to_engine(prompt))
        self.in_flight += 1
        try:
            for _ in range(params.max_tokens):
                self.batches.append(self.in_flight)
                await asyncio.sleep(0)
        finally:
            self.in_flight -= 1
        return int(params.max_tokens)


def test_lengths_shrink_the_batch_one_row_per_step() -> None:
    assert warmup_lengths(4) == [4, 3, 2, 1]
    assert WARMUP_ROWS > 64  # above vLLM 0.32's split-row limit (and 0.25's 8 rows)


def test_samplings_default_voice_first_and_distinct() -> None:
    a, b = VoiceSampling(top_p=0.9), VoiceSampling(temperature=0.4)
    cfg = LLMConfig(default_voice="leo", voice_sampling={"leo": a, "tara": b, "zac": b})
    assert warmup_samplings(cfg) == [a, VoiceSampling(), b]
    assert warmup_samplings(LLMConfig()) == [VoiceSampling()]


async def test_warm_up_samples_every_batch_size_with_the_configured_sampling(
    prompts: PromptBuilder,
) -> None:
    tara = VoiceSampling(temperature=0.5, top_p=0.7, repetition_penalty=1.2)
    cfg = LLMConfig(max_num_seqs=384, voice_sampling={"tara": tara})
    engine = FakeEngine(TokenSpace.full())
    done = await warm_up(engine, prompts, cfg, SamplingHooks())
    assert done.rows == WARMUP_ROWS and done.samplings == 2
    assert max(engine.batches) == WARMUP_ROWS
    assert set(engine.batches) == set(range(1, WARMUP_ROWS + 1))
    assert sorted(p.max_tokens for p in engine.params) == list(range(1, WARMUP_ROWS + 1))
    assert all(p.min_tokens == p.max_tokens for p in engine.params)
    assert {(p.temperature, p.top_p) for p in engine.params} == {(0.5, 0.7), (0.6, 0.8)}
    assert all(p.stop_token_ids == [T.END_OF_SPEECH] for p in engine.params)
    assert engine.prompts[0][0] == T.START_OF_HUMAN
    assert "warm-up 72 rows" in done.describe()


async def test_warm_up_fits_max_num_seqs_and_speaks_the_audio_heads_ids(
    prompts: PromptBuilder,
) -> None:
    space = TokenSpace.audio(T.VOCAB_SIZE)
    engine = FakeEngine(space)
    done = await warm_up(engine, prompts, LLMConfig(max_num_seqs=16), SamplingHooks())
    assert done.rows == 16 and max(engine.batches) == 16
    assert all(p.stop_token_ids == [space.end_of_speech] for p in engine.params)
    assert engine.prompts[0] == space.to_engine(prompts.build("tara", "Warming up, row 0."))
