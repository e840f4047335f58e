"""What the startup log states about a built engine: the model runner, attention backend,
scheduling, dtypes and the KV cache vLLM decided on (read from its ``VllmConfig``)."""

from __future__ import annotations

import msgspec
from vllm.config import VllmConfig
from vllm.v1.engine.async_llm import AsyncLLM


class EngineInfo(msgspec.Struct, frozen=True):
    """What the startup log states about the engine."""

    model_runner: str
    attention_backend: str
    scheduling: str
    dtype: str
    kv_cache_dtype: str
    device: str
    kv_blocks: int = 0
    """KV cache blocks the engine got (0: not reported)."""
    block_size: int = 0
    max_model_len: int = 0
    max_num_seqs: int = 0

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.block_size

    def describe(self) -> str:
        kv = ""
        if self.kv_tokens:
            full = self.kv_tokens // max(1, self.max_model_len)
            kv = (
                f"; KV cache {self.kv_blocks} blocks ({self.kv_tokens} tokens: "
                f"{full} streams at the full {self.max_model_len} tokens); "
                f"max streams {self.max_num_seqs}"
            )
        return (
            f"device {self.device}; model runner {self.model_runner}; attention backend "
            f"{self.attention_backend}; scheduling {self.scheduling}; dtype {self.dtype}; "
            f"KV cache dtype {self.kv_cache_dtype}{kv}"
        )


def _attention_backend(vllm_config: VllmConfig) -> str:
    """The attention backend vLLM selects for this model (same call its layers make)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    mc = vllm_config.model_config
    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(
                mc.get_head_size(),
                mc.dtype,
                vllm_config.cache_config.cache_dtype,
                num_heads=mc.get_num_attention_heads(vllm_config.parallel_config),
            )
        return backend.get_name()
    except Exception as e:  # a log line must not stop the worker
        configured = vllm_config.attention_config.backend
        return f"{configured or 'auto'} (not resolved here: {type(e).__name__}: {e})"


def describe_engine(engine: AsyncLLM, device: str) -> EngineInfo:
    vc = engine.vllm_config
    if vc.use_v2_model_runner:
        runner = "V2"
    else:
        runner = "V1 (legacy)"
    async_on = bool(vc.scheduler_config.async_scheduling)
    return EngineInfo(
        model_runner=runner,
        attention_backend=_attention_backend(vc),
        scheduling="async (overlapped with execution)" if async_on else "synchronous",
        dtype=str(vc.model_config.dtype).removeprefix("torch."),
        kv_cache_dtype=str(vc.cache_config.cache_dtype),
        device=device,
        kv_blocks=int(vc.cache_config.num_gpu_blocks or 0),
        block_size=int(vc.cache_config.block_size or 0),
        max_model_len=int(vc.model_config.max_model_len),
        max_num_seqs=int(vc.scheduler_config.max_num_seqs),
    )
