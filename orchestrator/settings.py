"""Loading ServeConfig: device profile defaults, then the TOML file, then environment
variables, then command-line flags (each overrides the one before).

Environment variables are ``ORPHEUS_<SECTION>__<KEY>`` (``ORPHEUS_LLM__MAX_NUM_SEQS=128``) or
``ORPHEUS_<KEY>`` for top-level keys (``ORPHEUS_DEVICE=cpu``). Flags use ``--set
section.key=value``; the common ones have their own flags (``--model``, ``--port`` ...).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tomllib
from collections.abc import Mapping
from typing import Any

import msgspec

from common.config import FOLDED_KEYS, ServeConfig
from common.languages import UnknownLanguage, language_tag
from common.limits import MAX_TOKENS_MIN, sampling_problem
from shm.layout import MAX_ENGINES
from store.voices import ID_RE as VOICE_ID_RE

ENV_PREFIX = "ORPHEUS_"
# Variables under the prefix that are not configuration keys: the child spec and the
# profiling hooks (docs/gpu.md).
NON_CONFIG_ENV_PREFIXES = ("ORPHEUS_SERVE_", "ORPHEUS_PROFILE_")

# Defaults that differ on a development CPU machine (the demo and tests use these).
CPU_PROFILE: dict[str, Any] = {
    # An overloaded 2-core machine can hold one codec batch for tens of seconds: a hung
    # worker is still caught, just later (a heartbeat kill there loses every stream).
    "heartbeat_timeout_s": 300.0,
    # float32: this class of CPU has no native bf16 (no AVX-512), and emulated bf16 made the
    # tiny model's 156,940-row LM head 3x slower than float32 (docs/performance.md).
    "llm": {"max_num_seqs": 64, "max_model_len": 2048, "enforce_eager": True, "dtype": "float32"},
    "codec": {"compile": False, "max_batch": 32, "threads": 1},
    "gateway": {"max_active_streams": 64, "max_queued_streams": 64},
    "shm": {"code_ring_bytes": 1 << 20, "pcm_ring_bytes": 16 << 20},
}


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and why."""


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _parse_scalar(text: str) -> Any:
    """Environment and --set values: JSON when it parses (numbers, bools, lists), else text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _nest(dotted: str, value: Any, sep: str) -> dict[str, Any]:
    parts = [p for p in dotted.split(sep) if p]
    if not parts:
        raise ConfigError(f"empty configuration key in {dotted!r}")
    node: dict[str, Any] = {}
    cur = node
    for p in parts[:-1]:
        cur = cur.setdefault(p, {})
    cur[parts[-1]] = value
    return node


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(NON_CONFIG_ENV_PREFIXES):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        out = _merge(out, _nest(key, _parse_scalar(raw), "__"))
    return out


def set_overrides(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set takes section.key=value, got {pair!r}")
        key, raw = pair.split("=", 1)
        out = _merge(out, _nest(key.strip(), _parse_scalar(raw), "."))
    return out


def _has_key(layer: Mapping[str, Any], dotted: str) -> bool:
    node: Any = layer
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def load_config(
    toml_path: str | None = None,
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Build and validate the configuration. Raises ConfigError with a readable message."""
    file_layer: dict[str, Any] = {}
    if toml_path:
        try:
            with open(toml_path, "rb") as f:
                file_layer = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read config file {toml_path}: {exc}") from exc
    env_layer = env_overrides(os.environ if environ is None else environ)
    flag_layer = dict(flags or {})
    merged = _merge(_merge(file_layer, env_layer), flag_layer)
    device = merged.get("device", ServeConfig().device)
    if device == "cpu":
        merged = _merge(_merge(CPU_PROFILE, file_layer), _merge(env_layer, flag_layer))
    folded = [
        f"{key} is no longer a setting: {why}"
        for key, why in FOLDED_KEYS.items()
        if _has_key(merged, key)
    ]
    if folded:
        raise ConfigError("; ".join(folded))
    try:
        cfg = msgspec.convert(merged, ServeConfig, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from exc
    validate(cfg)
    return cfg


def is_set(
    toml_path: str | None,
    flags: Mapping[str, Any] | None,
    section: str,
    key: str,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether ``section.key`` was given by the TOML file, the environment or a flag (as
    opposed to left at its default)."""
    layers: list[Mapping[str, Any]] = [
        dict(flags or {}),
        env_overrides(os.environ if environ is None else environ),
    ]
    if toml_path:
        try:
            with open(toml_path, "rb") as f:
                layers.append(tomllib.load(f))
        except (OSError, tomllib.TOMLDecodeError):
            pass
    for layer in layers:
        table = layer.get(section)
        if isinstance(table, Mapping) and key in table:
            return True
    return False


def describe(cfg: ServeConfig, toml_path: str | None = None) -> str:
    """One line for the start-up log: where the configuration came from and what matters most."""
    from orchestrator.logs import library_level

    g = cfg.gateway
    host = f"[{g.host}]" if ":" in g.host else g.host
    source = f"{toml_path}, environment, flags" if toml_path else "defaults, environment, flags"
    libraries = logging.getLevelName(library_level(cfg.log_level))
    return (
        f"config loaded ({source}): device {cfg.device}, model {cfg.llm.model}, "
        f"http://{host}:{g.port}, {g.processes} gateway process(es), log level "
        f"{cfg.log_level.upper()} (libraries {libraries})"
    )


def language_problems(cfg: ServeConfig) -> list[str]:
    """Each configured language that is not an ISO 639-1 code (``common.languages``)."""
    named = {"text.language": [cfg.text.language]}
    named["llm.languages"] = list(cfg.llm.languages or [])
    named.update(
        {f"llm.voice_languages.{v}": [lang] for v, lang in cfg.llm.voice_languages.items()}
    )
    named.update(
        {f"llm.lora_voices.{v}.language": [lv.language] for v, lv in cfg.llm.lora_voices.items()
         if lv.language is not None}
    )  # fmt: skip
    problems = []
    for key, codes in named.items():
        for code in codes:
            try:
                language_tag(code)
            except UnknownLanguage as e:
                problems.append(f"{key}: {e}")
    return problems


def validate(cfg: ServeConfig) -> None:
    problems: list[str] = []
    if cfg.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        problems.append(f"log_level {cfg.log_level!r} is not DEBUG|INFO|WARNING|ERROR|CRITICAL")
    c = cfg.codec
    if c.hop_frames < 1 or c.first_hop_frames < 1:
        problems.append("codec.hop_frames and codec.first_hop_frames must be >= 1")
    if min(c.context_frames, c.lookahead_frames, c.first_lookahead_frames) < 0:
        problems.append("codec context/lookahead frames must be >= 0")
    if c.max_hop_frames < c.hop_frames:
        problems.append("codec.max_hop_frames must be >= codec.hop_frames")
    if c.max_batch < 1 or c.max_wait_ms < 0:
        problems.append("codec.max_batch must be >= 1 and codec.max_wait_ms >= 0")
    llm = cfg.llm
    if not 0 < llm.gpu_memory_utilization <= 1:
        problems.append("llm.gpu_memory_utilization must be in (0, 1]")
    if llm.max_model_len < 256:
        problems.append("llm.max_model_len must be >= 256")
    if llm.max_num_seqs < 1:
        problems.append("llm.max_num_seqs must be >= 1")
    if not 1 <= llm.engines <= MAX_ENGINES:
        problems.append(f"llm.engines must be in 1..{MAX_ENGINES}")
    if llm.kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"):
        problems.append(f"llm.kv_cache_dtype {llm.kv_cache_dtype!r} is not auto|fp8|bfloat16")
    if llm.model_runner not in ("auto", "v1", "v2"):
        problems.append(f"llm.model_runner {llm.model_runner!r} is not auto|v1|v2")
    elif llm.model_runner == "v2" and cfg.device == "cpu":
        problems.append("llm.model_runner v2 needs the GPU build of vLLM (--device cuda)")
    if llm.max_lora_rank not in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        problems.append("llm.max_lora_rank must be one of 1 8 16 32 64 128 256 320 512 (vLLM's)")
    if llm.max_loras < 1:
        problems.append("llm.max_loras must be >= 1")
    if not llm.lora_sync_s >= 0:
        problems.append("llm.lora_sync_s must be >= 0 (0: off)")
    if llm.max_tokens_cap < MAX_TOKENS_MIN:
        problems.append(f"llm.max_tokens_cap must be >= {MAX_TOKENS_MIN} (one frame of codes)")
    # A voice's defaults must be what a request may ask for (common.limits): the llm_worker
    # checks a request's overrides only.
    defaults = {"llm.sampling": llm.sampling}
    defaults.update({f"llm.voice_sampling.{v}": s for v, s in llm.voice_sampling.items()})
    for key, sampling in defaults.items():
        if (problem := sampling_problem(sampling)) is not None:
            problems.append(f"{key}: {problem}")
    for name in llm.lora_voices:
        if not VOICE_ID_RE.match(name.strip().lower()):
            problems.append(f"llm.lora_voices: {name!r} is not a voice name (letters, digits, _-.)")
        elif name.strip().lower() in (llm.voices or []):
            problems.append(f"llm.lora_voices: {name!r} is also a voice of the model")
    problems.extend(language_problems(cfg))
    v = cfg.voices
    if not 0 < v.min_seconds <= v.max_seconds:
        problems.append("voices: 0 < min_seconds <= max_seconds")
    if v.max_voices < 0:
        problems.append("voices.max_voices must be >= 0")
    if cfg.heartbeat_timeout_s <= 1:
        problems.append("heartbeat_timeout_s must be > 1")
    g = cfg.gateway
    if not 0 < g.port < 65536:
        problems.append(f"gateway.port {g.port} is not a TCP port")
    if g.processes < 1:
        problems.append("gateway.processes must be >= 1")
    if g.max_active_streams < 1 or g.max_queued_streams < 0:
        problems.append("gateway.max_active_streams >= 1 and max_queued_streams >= 0")
    if not g.ttfb_budget_s > 0 or not g.realtime_margin >= 0:
        problems.append("gateway.ttfb_budget_s must be > 0 and realtime_margin >= 0")
    if g.max_streams_per_key < 0 or any(n < 0 for n in g.key_max_streams.values()):
        problems.append("gateway.max_streams_per_key and key_max_streams must be >= 0")
    if not all(w > 0 and math.isfinite(w) for w in g.key_weights.values()):
        problems.append("gateway.key_weights must be finite and > 0")
    if g.zmq_max_message_bytes < 1024:
        problems.append("gateway.zmq_max_message_bytes must be >= 1024 (one speak message)")
    if not g.zmq_text_idle_timeout_s > 0 or not g.http_error_log_interval_s >= 0:
        problems.append(
            "gateway.zmq_text_idle_timeout_s must be > 0, http_error_log_interval_s >= 0"
        )
    s = cfg.shm
    if s.code_ring_bytes < 64 << 10 or s.pcm_ring_bytes < 256 << 10:
        problems.append("shm.code_ring_bytes >= 64 KiB and shm.pcm_ring_bytes >= 256 KiB")
    if problems:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(problems))
