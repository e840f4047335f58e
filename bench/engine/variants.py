"""The variants (``--variants``): each one's configuration change, where it cannot apply, the
engine built for it as the llm worker builds its own, and the command line's lists."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from bench.engine.results import MAX_ENGINES, MIN_MODEL_LEN, PROMPT_ROOM, VARIANT_NAMES
from common.cpu_plan import CpuPlan


def variant_overrides(name: str, lever_head: str = "full") -> dict[str, Any]:
    """The ``[llm]`` settings a variant changes (on top of the device's profile); the lever
    variants (all but the two heads) change one thing from ``lever_head``."""
    base: dict[str, Any] = {"output_head": lever_head}
    if name == "full-head":
        return {"output_head": "full"}
    if name == "audio-head":
        return {"output_head": "audio"}
    if name == "top-p-off":
        return {**base, "sampling": {"top_p": 1.0}}
    if name == "prefix-cache-off":
        return {**base, "enable_prefix_caching": False}
    if name == "stats-off":
        return {**base, "engine_stats": False}
    if name == "kv-fp8":
        return {**base, "kv_cache_dtype": "fp8"}
    raise ValueError(f"unknown variant {name!r} (known: {', '.join(VARIANT_NAMES)})")


def not_applicable(name: str, device: str) -> str | None:
    """Why a variant cannot run here (None: it can)."""
    if name == "kv-fp8" and device != "cuda":
        return "the fp8 KV cache is measured on CUDA only"
    return None


def engine_config(args: argparse.Namespace, variant: str, max_num_seqs: int) -> Any:
    """The server's ``LLMConfig`` of one of ``args.engine_count`` engines sharing the device:
    ``llm.engines`` is K, so ``llm_worker.engine.args.engine_args`` gives it its share as it does
    in the server (on CUDA ``gpu_memory_utilization / K``, and ``kv_cache_memory_bytes / K``
    where set; on CPU the KV cache follows its own ``max_num_seqs``)."""
    from orchestrator.settings import load_config

    llm: dict[str, Any] = {
        "model": args.model,
        "engines": args.engine_count,
        "max_num_seqs": max_num_seqs,
        "max_model_len": max(MIN_MODEL_LEN, args.tokens + PROMPT_ROOM),
        **variant_overrides(variant, args.lever_head),
    }
    return load_config(None, {"device": args.device, "llm": llm}).llm


def engine_cores(cores: Sequence[int], engines: int) -> list[str]:
    """Each engine's cores on CPU (``VLLM_CPU_OMP_THREADS_BIND``): the server's split of its
    engine cores (``common.cpu_plan``), here over every core this benchmark may use (there is
    no codec or gateway to keep cores for)."""
    plan = CpuPlan(engine=tuple(sorted(cores)), others=(), engines=engines)
    return [",".join(map(str, plan.engine_cores(e))) for e in range(engines)]


def check_head(variant: str, head: Any, lever_head: str = "full") -> None:
    """Raise where the head the engine will run is not the one the variant names."""
    from llm_worker.vllm_ext.token_space import HeadKind

    name = {"audio-head": "audio", "full-head": "full"}.get(variant, lever_head)
    want = HeadKind.AUDIO if name == "audio" else HeadKind.FULL
    if head.space.kind is not want:
        raise RuntimeError(f"{variant}: the engine would run {head.describe()}")
    if want is HeadKind.AUDIO and not plugin_registered():
        raise RuntimeError(
            "the audio head's vLLM plugin is not registered in this environment (entry point "
            "vllm.general_plugins, llm_worker.vllm_ext.plugin:register); fix: reinstall the "
            "project (pip install -e .)"
        )


def plugin_registered() -> bool:
    """Whether vLLM will load the project's plugin (audio head, phase timers)."""
    plugins = {e.value for e in metadata.entry_points(group="vllm.general_plugins")}
    return "llm_worker.vllm_ext.plugin:register" in plugins


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    for v in names:
        variant_overrides(v)  # raises for an unknown name
    if len(set(names)) != len(names):
        raise ValueError(f"a variant is named twice in {text!r}")
    return names


def _integers(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, not {text!r}") from None


def parse_streams(text: str) -> list[int]:
    levels = _integers(text, "--streams")
    if not levels or min(levels) < 1:
        raise ValueError("--streams needs at least one level, each >= 1")
    return levels


def parse_engines(text: str) -> list[int]:
    counts = _integers(text, "--engines")
    if not counts or min(counts) < 1 or max(counts) > MAX_ENGINES:
        raise ValueError(f"--engines needs at least one count, each in 1..{MAX_ENGINES}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"an engine count is named twice in {text!r}")
    return counts
