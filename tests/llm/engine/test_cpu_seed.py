"""Seeded requests whose prompts do not all fit one engine step, in the real vLLM CPU engine.

vLLM's chunked prefill rewinds a split request's generator by a Philox offset, which CPU
generators do not have: one seeded request cut at a step's token budget killed the engine
(the 2-hour soak, docs/performance.md). The worker's CPU engine arguments prefill every
prompt in one step; here more prompt tokens arrive at once than one step takes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from offline_engine import sync_llm
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

from common.config.llm import LLMConfig
from llm_worker.engine.args import engine_args
from testkit.tiny_model import write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODEL_LEN = 128
PROMPT = 60  # two prompts fill a step's budget; a third would be split with chunked prefill
STREAMS = 8


def test_seeded_prompts_over_a_steps_budget_complete(tmp_path: Path) -> None:
    write_tiny_model(tmp_path)
    cfg = LLMConfig(
        model=str(tmp_path),
        max_model_len=MODEL_LEN,
        max_num_seqs=STREAMS,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=32 << 20,
    )
    args = engine_args(cfg, "cpu", [])
    assert args.enable_chunked_prefill is False
    assert args.max_num_batched_tokens == MODEL_LEN
    engine = sync_llm(args)
    try:
        prompts = [
            TokensPrompt(prompt_token_ids=list(range(1000 + i, 1000 + i + PROMPT)))
            for i in range(STREAMS)
        ]
        params = [SamplingParams(seed=i, max_tokens=4, detokenize=False) for i in range(STREAMS)]
        first = engine.generate(prompts, params, use_tqdm=False)
        again = engine.generate(prompts, params, use_tqdm=False)
    finally:
        del engine
    assert [len(o.outputs[0].token_ids) for o in first] == [4] * STREAMS
    # The seed still fixes the codes when the prompts are scheduled over several steps.
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
