"""The worker's own vLLM engine arguments in a synchronous ``vllm.LLM``, for tests that drive
the real CPU engine offline (no worker process, no event loop)."""

from __future__ import annotations

from e2e_harness import note_engine_start
from vllm import LLM
from vllm.engine.arg_utils import AsyncEngineArgs

# The engine arguments every such test keeps as the worker sets them.
_SHARED = (
    "model", "skip_tokenizer_init", "max_model_len", "max_num_seqs", "dtype", "enforce_eager",
    "kv_cache_memory_bytes", "generation_config", "enable_chunked_prefill",
    "max_num_batched_tokens",
)  # fmt: skip


def sync_llm(args: AsyncEngineArgs, *extra: str) -> LLM:
    """An offline engine built from ``args`` (``llm_worker.engine_args.engine_args``): the shared
    fields plus ``extra`` (the feature under test), with a fixed engine seed."""
    note_engine_start("offline engine")
    return LLM(**{k: getattr(args, k) for k in (*_SHARED, *extra)}, seed=0)
