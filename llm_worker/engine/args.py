"""The engine's arguments: ``AsyncEngineArgs`` from the ``[llm]`` configuration.

- Token ids in (``skip_tokenizer_init``), token ids out (``detokenize=False`` per request):
  vLLM does no tokenizer or detokenizer work on audio tokens.
- ``max_model_len`` always set (the checkpoint declares 131k).
- Async scheduling wherever the installed vLLM supports it: left to vLLM's own decision
  (``None``), which turns it on for the GPU runners and the CPU platform turns it off.
- The KV cache on the CPU build: what ``max_num_seqs`` streams of ``max_model_len`` tokens
  need (:func:`cpu_kv_cache_bytes`, from the checkpoint's config.json), within bounds; with
  ``llm.engines`` K > 1 the device's memory settings are split evenly.
- The checkpoint's generation_config is not read: vLLM is given the project's empty one
  (:data:`GENERATION_CONFIG`). The worker's ``SamplingParams`` are the whole truth. (vLLM's
  ``generation_config="vllm"`` still reads the checkpoint's ``eos_token_id``, 128009, a text
  id, and adds it to every request's stop ids and min_tokens mask: a stray stop on the full
  head, an index past the logits' width on the audio head.)

:func:`prepare_engine_args` is the worker's one step from an :class:`~llm_worker.engine.plan.
EnginePlan` to the arguments: the device check and the environment
(:mod:`llm_worker.engine.env`), then :func:`engine_args`. :mod:`llm_worker.engine.engine` starts
the engine from them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from vllm.config import ProfilerConfig
from vllm.engine.arg_utils import AsyncEngineArgs

from common.config.llm import LLMConfig
from llm_worker.engine.env import check_device, prepare_engine_environment
from llm_worker.engine.output_head import HeadChoice
from llm_worker.model_info import find_model_file

if TYPE_CHECKING:
    from llm_worker.engine.plan import EnginePlan

GENERATION_CONFIG = str(Path(__file__).with_name("generation_config"))
"""A directory holding an empty ``generation_config.json``: no defaults, no stop ids."""
CPU_KV_CACHE_MAX_BYTES = 4 << 30
CPU_KV_CACHE_MIN_BYTES = 64 << 20


def prepare_engine_args(
    config: LLMConfig, device: str, plan: EnginePlan, profiler: ProfilerConfig | None = None
) -> AsyncEngineArgs:
    """The arguments of the engine ``plan`` says (its processors and output head), after
    the device check and the environment vLLM reads while it builds the engine."""
    check_device(device)
    prepare_engine_environment(config.cpu_onednn_cache, config.cpu_heap_trim_s)
    return engine_args(config, device, plan.logits_processors, profiler, plan.head)


def kv_bytes_per_token(model: str, kv_cache_dtype: str = "auto") -> int | None:
    """KV cache bytes one token takes, from the checkpoint's config.json (None if unknown)."""
    path = find_model_file(model, "config.json")
    if path is None:
        return None
    cfg = json.loads(path.read_text())
    try:
        layers = int(cfg["num_hidden_layers"])
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads", heads))
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    except (KeyError, TypeError, ValueError):
        return None
    elem = 1 if kv_cache_dtype.startswith("fp8") else 2
    return 2 * layers * kv_heads * head_dim * elem


def cpu_kv_cache_bytes(config: LLMConfig) -> int:
    """KV cache for ``max_num_seqs`` streams of ``max_model_len`` tokens, within bounds."""
    per_token = kv_bytes_per_token(config.model, config.kv_cache_dtype)
    if per_token is None:
        return CPU_KV_CACHE_MAX_BYTES
    need = per_token * config.max_model_len * config.max_num_seqs
    return max(CPU_KV_CACHE_MIN_BYTES, min(need, CPU_KV_CACHE_MAX_BYTES))


def engine_args(
    config: LLMConfig,
    device: str,
    logits_processors: list[type],
    profiler: ProfilerConfig | None = None,
    head: HeadChoice | None = None,
) -> AsyncEngineArgs:
    """The engine's arguments; ``head`` None is the checkpoint's own (full) head.

    With ``config.engines`` K > 1 this is one engine's: ``gpu_memory_utilization`` and an
    explicit ``kv_cache_memory_bytes`` are the whole device's, split evenly (each engine
    process holds its own weights, CUDA graphs and KV cache). On CPU the KV cache is what
    the engine's own ``max_num_seqs`` streams need, as with one engine."""
    share = max(1, config.engines)
    kv_bytes = config.kv_cache_memory_bytes
    if kv_bytes is not None:
        kv_bytes //= share
    elif device == "cpu":
        kv_bytes = cpu_kv_cache_bytes(config)
    return AsyncEngineArgs(
        model=config.model,
        tokenizer=config.tokenizer,
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        gpu_memory_utilization=config.gpu_memory_utilization / share,
        kv_cache_memory_bytes=kv_bytes,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        quantization=config.quantization,
        enforce_eager=config.enforce_eager,
        # None: vLLM enables it wherever it is supported (never on the CPU build).
        async_scheduling=None if config.async_scheduling else False,
        seed=config.seed,
        generation_config=GENERATION_CONFIG,
        **({"hf_overrides": o} if head is not None and (o := head.hf_overrides()) else {}),
        logits_processors=logits_processors or None,
        disable_log_stats=not config.engine_stats,
        # Multi-LoRA for LoRA voices; prefix caching (vLLM's default) keeps custom voices'
        # reference prefixes, and is stated here because custom voices depend on it.
        enable_prefix_caching=config.enable_prefix_caching,
        **_lora_args(config, device),
        **_prefill_args(config, device),
        enable_log_requests=False,
        # tqdm's own switch (the orchestrator sets it below log_level DEBUG) also governs
        # vLLM's weight-loading bar, which passes tqdm an explicit `disable`.
        use_tqdm_on_load=not _tqdm_disabled(),
        **({"profiler_config": profiler} if profiler is not None else {}),
    )


def _prefill_args(config: LLMConfig, device: str) -> dict[str, object]:
    """On the CPU build, every prompt is prefilled in one step.

    When vLLM splits a prefill across steps (chunked prefill) it discards the token sampled
    for the unfinished request and rewinds that request's generator by a Philox offset
    (``gen.set_offset(gen.get_offset() - 4)`` in the model runner's bookkeeping); a request
    has a generator when it carries a ``seed``, and CPU generators have no offset: the worker
    raises and the whole engine dies (0.25.1 and 0.32). Without chunked prefill a prompt that
    does not fit the step's token budget waits for the next step instead of being split; the
    budget is at least ``max_model_len`` tokens, so every admissible prompt fits one step. CUDA
    generators have offsets: the GPU keeps vLLM's default."""
    if device != "cpu":
        return {}
    return {
        "enable_chunked_prefill": False,
        # vLLM also wants a step to take at least one token of every running stream.
        "max_num_batched_tokens": max(config.max_model_len, config.max_num_seqs),
    }


def _tqdm_disabled() -> bool:
    return os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


LORA_CPU_FIX = "llm_worker.vllm_ext.lora_cpu.LoraCpuFix"


def _lora_args(config: LLMConfig, device: str) -> dict[str, object]:
    if not config.lora_enabled:
        return {}
    args: dict[str, object] = {
        "enable_lora": True,
        "max_loras": config.max_loras,
        "max_lora_rank": config.max_lora_rank,
        "max_cpu_loras": config.max_cpu_loras,
    }
    if device == "cpu":
        # vLLM's CPU LoRA ops apply the last adapter to requests without one (lora_cpu.py).
        args["worker_extension_cls"] = LORA_CPU_FIX
    return args
