"""The baseline's vLLM engine, prompt and sampling.

The engine is built from the same ``LLMConfig`` and the same ``llm_worker.engine.args.engine_args``
as orpheus-serve's (model, max_model_len, max_num_seqs, dtype, KV cache size, eager mode,
async scheduling where supported, seed): the comparison is about how audio is produced
from the engine's tokens, not about engine settings. What differs is what the reference
package does differently: vLLM's own repetition penalty (not orpheus-serve's tensor
penalty), one output stream per request, and the reference decoder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from common.config.llm import LLMConfig
from llm_worker.vllm_ext import tokens as T

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM


def build_engine(config: LLMConfig, device: str) -> AsyncLLM:
    """vLLM's async engine (V1 ``AsyncLLM``; the package's ``AsyncLLMEngine`` is its alias)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from bench.compare.baseline.constraint import AudioSlotConstraint
    from llm_worker.engine.args import engine_args
    from llm_worker.engine.env import check_device, prepare_engine_environment

    check_device(device)
    prepare_engine_environment()
    args = engine_args(config, device, [AudioSlotConstraint])
    args.disable_log_stats = True  # the baseline exports no vllm:* metrics
    return AsyncLLM.from_engine_args(args)


def load_tokenizer(config: LLMConfig) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.tokenizer or config.model)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, voice: str, text: str) -> list[int]:
    """``128259``, the Llama-3 tokens of ``"{voice}: {text}"`` (BOS first), ``128009 128260
    128261 128257``: the reference's ``_format_prompt``, as ids rather than a re-decoded string."""
    body = tokenizer(f"{voice}: {text}")["input_ids"]
    return [*T.PROMPT_PREFIX, *body, *T.PROMPT_SUFFIX]


def max_tokens_for(config: LLMConfig, text: str, prompt_len: int) -> int:
    """orpheus-serve's cap on audio tokens by text length (the package's is a flat 1200)."""
    cap = int(len(text) * config.max_tokens_per_char)
    cap = max(config.min_max_tokens, min(cap, config.max_tokens_cap))
    return max(1, min(cap, config.max_model_len - prompt_len))


def sampling_params(config: LLMConfig, max_tokens: int, *, fixed: bool) -> SamplingParams:
    """orpheus-serve's default sampling values (``llm.sampling``: temperature, top_p, ...),
    token ids out, one delta per engine step, no detokenizer; stop on end-of-speech
    (128258: the package's default 49158 is an ordinary text token and never fires).
    ``fixed`` makes the output exactly ``max_tokens`` long (random-weight benchmarks)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        **msgspec.structs.asdict(config.sampling),
        max_tokens=max_tokens,
        min_tokens=max_tokens if fixed else 0,
        stop_token_ids=[T.END_OF_SPEECH],
        output_kind=RequestOutputKind.DELTA,
        detokenize=False,
    )
