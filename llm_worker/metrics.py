"""The llm_worker's own Prometheus metrics (``orpheus_llm_*``).

The orchestrator sets ``PROMETHEUS_MULTIPROC_DIR`` before it starts the worker, so these
(and vLLM's ``vllm:*`` metrics, recorded by the engine's Prometheus stat logger in this
same process) land in the shared directory that the gateway's ``/metrics`` collects.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_SECONDS_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0)

TOKENS_PER_STEP = Histogram(
    "orpheus_llm_tokens_per_step",
    "Audio tokens mapped to codes per engine step (all streams together).",
    buckets=_STEP_TOKEN_BUCKETS,
)
STEP_SECONDS = Histogram(
    "orpheus_llm_step_publish_seconds",
    "Worker time per engine step: map tokens to frames and publish them to the code ring.",
    buckets=_SECONDS_BUCKETS,
)
FRAMES_WRITTEN = Counter("orpheus_llm_frames_written", "SNAC code frames written to the code ring.")
FRAMES_DROPPED = Counter(
    "orpheus_llm_frames_dropped",
    "Frames not written: 'invalid' held a token outside its slot's range; 'incomplete' was "
    "cut by the end of a generation.",
    ["reason"],
)
INVALID_TOKENS = Counter(
    "orpheus_llm_invalid_tokens",
    "Generated tokens outside their slot's audio range (each drops its frame).",
)
INVALID_TOKENS_PREVENTED = Counter(
    "orpheus_llm_invalid_tokens_prevented",
    "Invalid audio tokens the sampling constraint prevented (counted in the engine).",
)
REPETITION_STOPS = Counter(
    "orpheus_llm_repetition_stops",
    "Generations ended by the repetition guard (runaway loops).",
)
STREAMS = Counter(
    "orpheus_llm_streams",
    "Streams finished, by outcome (stop, length, repetition, cancelled, error, bad_request).",
    ["outcome"],
)
SEGMENTS = Counter("orpheus_llm_segments", "vLLM requests started (one per piece of text).")
ACTIVE_STREAMS = Gauge(
    "orpheus_llm_active_streams", "Streams the worker holds.", multiprocess_mode="livesum"
)
RING_WAIT_SECONDS = Histogram(
    "orpheus_llm_ring_wait_seconds",
    "Time the worker waited for space in a full code ring.",
    buckets=_SECONDS_BUCKETS,
)
