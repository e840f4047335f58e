"""Offline vLLM engines (a synchronous ``vllm.LLM``) for tests that drive the real CPU engine
without a worker process or an event loop, laid out as the server's engine is.

An ``LLM`` runs its engine core in a process of its own. vLLM's CPU platform would put the
model worker in a third process (it turns the ``"uni"`` executor into ``"mp"``), as it would
the server's but for ``llm_worker.engine.env.worker_in_engine_core``, whose switch would here
pull the whole engine into the test's process. Naming the one-process executor by its class
(an engine argument vLLM takes, ``distributed_executor_backend``) keeps the worker in the engine
core: one spawn and one import of vLLM fewer per engine."""

from __future__ import annotations

from typing import Any

import psutil
from e2e_harness import note_engine_start
from vllm import LLM
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.executor.uniproc_executor import UniProcExecutor

# The engine arguments every such test keeps as the worker sets them.
_SHARED = (
    "model", "skip_tokenizer_init", "max_model_len", "max_num_seqs", "dtype", "enforce_eager",
    "kv_cache_memory_bytes", "generation_config", "enable_chunked_prefill",
    "max_num_batched_tokens",
)  # fmt: skip


def offline_llm(**engine_args: Any) -> LLM:
    """An offline engine with ``engine_args``, its model worker in its engine core process."""
    note_engine_start("offline engine")
    llm = LLM(distributed_executor_backend=UniProcExecutor, **engine_args)
    titles = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
    assert not [t for t in titles if t.startswith("VLLM::Worker")], titles
    return llm


def sync_llm(args: AsyncEngineArgs, *extra: str) -> LLM:
    """An offline engine built from ``args`` (``llm_worker.engine.args.engine_args``): the shared
    fields plus ``extra`` (the feature under test), with a fixed engine seed."""
    return offline_llm(**{k: getattr(args, k) for k in (*_SHARED, *extra)}, seed=0)
