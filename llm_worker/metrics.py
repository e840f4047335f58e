"""The llm_worker's own Prometheus metrics (``orpheus_llm_*``).

The orchestrator sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the worker, so these
(and vLLM's ``vllm:*`` metrics, recorded by the engine's Prometheus stat logger in this
same process) land in the shared directory that the gateway's ``/metrics`` collects.

Every metric carries the ``engine`` label: the index of this worker's vLLM engine
(``llm.engines``), which the orchestrator passes in ``ORPHEUS_SERVE_ENGINE``. The metrics
without a label of their own are bound to it here; the others take it first
(``STREAMS.labels(ENGINE, outcome)``).
"""

from __future__ import annotations

import os

from prometheus_client import Counter, Gauge, Histogram

ENGINE_ENV = "ORPHEUS_SERVE_ENGINE"
ENGINE = os.environ.get(ENGINE_ENV, "0")
"""This process's engine index, the ``engine`` label's value."""

_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)
_ENGINE = ["engine"]

TOKENS_PER_STEP = Histogram(
    "orpheus_llm_tokens_per_step",
    "Audio tokens mapped to codes per engine step (all streams together).",
    _ENGINE,
    buckets=_STEP_TOKEN_BUCKETS,
).labels(ENGINE)
STEP_SECONDS = Histogram(
    "orpheus_llm_step_publish_seconds",
    "Worker time per engine step: map tokens to frames and publish them to the code ring.",
    _ENGINE,
    buckets=_SECONDS_BUCKETS,
).labels(ENGINE)
FRAMES_WRITTEN = Counter(
    "orpheus_llm_frames_written", "SNAC code frames written to the code ring.", _ENGINE
).labels(ENGINE)
FRAMES_DROPPED = Counter(
    "orpheus_llm_frames_dropped",
    "Frames not written: 'invalid' held a token outside its slot's range; 'incomplete' was "
    "cut by the end of a generation.",
    ["engine", "reason"],
)
INVALID_TOKENS = Counter(
    "orpheus_llm_invalid_tokens",
    "Generated tokens outside their slot's audio range (each drops its frame).",
    _ENGINE,
).labels(ENGINE)
INVALID_TOKENS_PREVENTED = Counter(
    "orpheus_llm_invalid_tokens_prevented",
    "Invalid audio tokens the sampling constraint prevented (counted in the engine).",
    _ENGINE,
).labels(ENGINE)
REPETITION_STOPS = Counter(
    "orpheus_llm_repetition_stops",
    "Generations ended by the repetition guard (runaway loops).",
    _ENGINE,
).labels(ENGINE)
STREAMS = Counter(
    "orpheus_llm_streams",
    "Streams finished, by outcome (stop, length, repetition, cancelled, error, bad_request).",
    ["engine", "outcome"],
)
SEGMENTS = Counter(
    "orpheus_llm_segments", "vLLM requests started (one per piece of text).", _ENGINE
).labels(ENGINE)
ACTIVE_STREAMS = Gauge(
    "orpheus_llm_active_streams",
    "Streams the worker holds.",
    _ENGINE,
    multiprocess_mode="livesum",
).labels(ENGINE)
RING_WAIT_SECONDS = Histogram(
    "orpheus_llm_ring_wait_seconds",
    "Time the worker waited for space in a full code ring.",
    _ENGINE,
    buckets=_SECONDS_BUCKETS,
).labels(ENGINE)
