"""What ``bench engine`` measures and reports: its defaults, a level per engine and over the
engines, a variant's result (the JSON's ``levels``)."""

from __future__ import annotations

import msgspec

REAL_TIME_STEP_MS = 11.5
"""The step time real-time streaming of ~10 s utterances needs at p99 (docs/performance.md)."""
STREAMS = (16, 64, 256)
VARIANT_NAMES = (
    "full-head", "audio-head", "top-p-off", "prefix-cache-off", "stats-off", "kv-fp8",
)  # fmt: skip
DEFAULT_TOKENS = {"cuda": 840, "cpu": 48}
"""Tokens per request: 840 is 120 frames, ~10 s of audio. The CPU defaults (tokens, steps)
keep a run within minutes: there a step at 256 streams takes about a second (vLLM's CPU
top-p sorts the whole vocabulary per row)."""
DEFAULT_STEPS = {"cuda": 300, "cpu": 60}
PROMPT_ROOM = 128
MIN_MODEL_LEN = 256
VARIANT_TIMEOUT_S = 3600
MAX_ENGINES = 8
PHASES_ENV = "ORPHEUS_PROFILE_PHASES"
"""llm_worker.vllm_ext.phase_timers.ENV: the directory an engine's processes write their phases to."""
PHASE_ORDER = (
    "schedule", "update_from_output", "runner_update_states", "runner_prepare_inputs",
    "runner_bookkeeping", "serialize",
)  # fmt: skip


class EngineLevel(msgspec.Struct, frozen=True):
    """One engine's share of a measured level."""

    engine: int
    streams: int
    steps: int
    """Step intervals in the window (at least ``--steps``)."""
    step_ms_p50: float
    step_ms_p99: float
    engine_cpu_ms_per_step: float | None
    tokens: int
    tokens_per_s: float
    frontend_cpu_ms_per_step: float
    """This engine's own process (vLLM's output processor, the closed loop) per step."""
    phases_us_per_request_step: dict[str, float] | None = None
    requests_per_step: dict[str, float] | None = None
    """The mean batch each phase counter saw (``scheduler``, ``runner``)."""


class Level(msgspec.Struct, frozen=True):
    """One measured level: the JSON's ``levels`` entries. The first seven fields are those
    of a single-engine run before the engines dimension existed; with K > 1, the step times
    are the slowest engine's, the CPU the engines' mean, tokens/s their sum."""

    variant: str
    streams: int
    step_ms_p50: float
    step_ms_p99: float
    engine_cpu_ms_per_step: float | None
    gpu_busy_fraction: float | None
    tokens_per_s: float
    engines: int = 1
    mps: bool | None = None
    """CUDA: whether the MPS control daemon was active (common.mps); None on CPU."""
    per_engine: list[EngineLevel] = []
    phases_us_per_request_step: dict[str, float] | None = None
    """The engines' mean µs per request-step by phase (None: timers off or not loaded)."""


class VariantResult(msgspec.Struct, frozen=True):
    variant: str
    status: str
    """``ok``, ``failed`` or ``skipped``."""
    reason: str | None = None
    engines: int = 1
    mps: bool | None = None
    engine: str | None = None
    sampling: str | None = None
    levels: list[Level] = []
    frontend_cpu_ms_per_step: dict[str, float] = {}
    """The engine processes' own CPU (vLLM's output processor, the closed loop) per step,
    by streams (the engines' mean)."""
    phase_timers: str | None = None
    """Which vLLM methods were timed and which were not found (one line)."""
