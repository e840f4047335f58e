"""LoRA voices in the real vLLM CPU engine, with the tiny model and random adapters written by
the project's own tiny-model code: two adapters in one batch each run with their own weights,
and the base model's voices are unaffected by them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from offline_engine import sync_llm
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

from common.config.llm import LLMConfig, LoraVoice
from llm_worker.engine.args import engine_args
from llm_worker.vllm_ext import tokens as T
from testkit.tiny_model import write_random_lora, write_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tiny") / "model"
    write_tiny_model(d)
    write_random_lora(d / "lora" / "ava", seed=1)
    write_random_lora(d / "lora" / "ben", seed=2)
    return d


@pytest.fixture(scope="module")
def llm(model: Path) -> Iterator[LLM]:
    cfg = LLMConfig(
        model=str(model),
        max_model_len=256,
        max_num_seqs=8,
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        lora_voices={"ava": LoraVoice(str(model / "lora" / "ava"))},
        max_loras=2,
        max_lora_rank=8,
    )
    # The worker's own engine arguments (multi-LoRA from [llm]), in a synchronous LLM.
    args = engine_args(cfg, "cpu", [])
    assert args.enable_lora and args.max_loras == 2 and args.max_lora_rank == 8
    assert args.enable_prefix_caching
    assert args.worker_extension_cls == "llm_worker.vllm_ext.lora_cpu.LoraCpuFix"
    engine = sync_llm(
        args, "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
        "enable_prefix_caching", "worker_extension_cls",
    )  # fmt: skip
    yield engine
    del engine


def _prompt() -> dict:
    return {"prompt_token_ids": [*T.PROMPT_PREFIX, T.BOS, 300, 301, 302, 303, *T.PROMPT_SUFFIX]}


def _params() -> SamplingParams:
    return SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=42, min_tokens=42, seed=7, detokenize=False
    )


def test_two_adapters_in_one_batch_and_the_base_model_unaffected(llm: LLM, model: Path) -> None:
    ava = LoRARequest("ava", 1, str(model / "lora" / "ava"))
    ben = LoRARequest("ben", 2, str(model / "lora" / "ben"))
    alone = llm.generate([_prompt()], [_params()], use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(
        [_prompt()] * 4,
        [_params()] * 4,
        lora_request=[ava, ben, None, ava],
        use_tqdm=False,
    )
    a, b, base, a2 = (list(o.outputs[0].token_ids) for o in outs)
    assert base == list(alone), (
        "the base model's voice is the same with adapters beside it (vLLM's CPU LoRA ops "
        "applied the last adapter slot to it before llm_worker/vllm_ext/lora_cpu.py)"
    )
    assert a == a2, "same adapter, seed and text: same tokens"
    assert a != b, "two adapters in one batch: each runs with its own weights"
    assert a != base and b != base, "an adapter changes the voice"
    # A LoRA voice alone gives what it gave in the mixed batch.
    ben_alone = llm.generate([_prompt()], [_params()], lora_request=ben, use_tqdm=False)
    assert list(ben_alone[0].outputs[0].token_ids) == b


def test_cpu_fix_masks_rows_without_an_adapter() -> None:
    """The replacement ops against vLLM's own: equal where a row has an adapter, zero where
    it has none (index -1); vLLM's gather reads -1 as the last slot."""
    import torch
    from vllm.lora.ops.torch_ops import lora_ops as vllm_ops

    from llm_worker.vllm_ext import lora_cpu

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 16, generator=g)
    a = torch.randn(2, 1, 8, 16, generator=g)  # (slots, 1, rank, in)
    idx = torch.tensor([0, 1, -1, 0])
    ours, theirs = torch.zeros(4, 8), torch.zeros(4, 8)
    lora_cpu.bgmv_shrink(x, a, ours, idx, 0.5)
    vllm_shrink = lora_cpu.ORIGINALS["bgmv_shrink"]
    assert vllm_shrink.__module__ == vllm_ops.__name__  # type: ignore[attr-defined]
    vllm_shrink(x, a, theirs, idx, 0.5)  # type: ignore[operator]
    rows = idx >= 0
    torch.testing.assert_close(ours[rows], theirs[rows])
    assert (ours[~rows] == 0).all() and (theirs[~rows] != 0).any()
    b = torch.randn(2, 1, 12, 8, generator=g)
    out = torch.ones(4, 12)
    lora_cpu.bgmv_expand(ours, b, out, idx, add_inputs=True)
    assert (out[2] == 1).all() and not (out[0] == 1).all()
    out2 = torch.ones(4, 20)
    lora_cpu.bgmv_expand_slice(ours, b, out2, idx, 4, 12, add_inputs=True)
    assert (out2[2] == 1).all() and (out2[:, :4] == 1).all() and not (out2[0, 4:16] == 1).all()
