"""Prometheus metrics of the codec worker.

The orchestrator sets PROMETHEUS_MULTIPROC_DIR, so these are written to per-process files
that the gateway's /metrics collects; gauges declare how processes combine. Without the
variable (tests, the benchmark) they are ordinary in-process metrics.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_WINDOW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)

BATCH_WINDOWS = Histogram(
    "orpheus_codec_batch_windows",
    "Decode windows in one codec batch (streams axis of 2D batching)",
    buckets=_WINDOW_BUCKETS,
)
WINDOW_HOP = Histogram(
    "orpheus_codec_window_hop_frames",
    "Frames emitted per decode window (time axis of 2D batching)",
    buckets=(1, 2, 4, 8, 16, 32),
)
QUEUE_WAIT = Histogram(
    "orpheus_codec_queue_wait_seconds",
    "Time a ready decode window waited before its batch was dispatched",
    buckets=_SECONDS_BUCKETS,
)
DECODE_TIME = Histogram(
    "orpheus_codec_decode_seconds",
    "Wall time of one codec batch from submit to PCM on the host",
    buckets=_SECONDS_BUCKETS,
)
RING_OCCUPANCY = Gauge(
    "orpheus_codec_ring_occupancy_ratio",
    "Fraction of a ring in use as seen by the codec worker (codes: input, pcm-N: output)",
    ["ring"],
    multiprocess_mode="livemax",
)
ACTIVE_STREAMS = Gauge(
    "orpheus_codec_active_streams",
    "Streams with state in the codec worker",
    multiprocess_mode="livesum",
)
DEADLINE_SLACK = Gauge(
    "orpheus_codec_min_deadline_slack_seconds",
    "Underrun risk: smallest playback slack among the windows of the last batch "
    "(negative: a chunk left after the player needed it)",
    multiprocess_mode="livemin",
)
LATE_WINDOWS = Counter(
    "orpheus_codec_late_windows_total",
    "Windows that were ready before their playback deadline but left the codec after it",
)
SHORT_LOOKAHEAD_WINDOWS = Counter(
    "orpheus_codec_short_lookahead_windows_total",
    "Windows decoded with the first window's shorter lookahead because the stream's playback "
    "deadline was near (codec.late_lookahead_ms)",
)
STREAMS_FAILED = Counter(
    "orpheus_codec_streams_failed_total",
    "Streams the codec worker failed, by reason",
    ["reason"],
)
STREAMS_FINISHED = Counter(
    "orpheus_codec_streams_finished_total",
    "Streams the codec worker finished, by END reason",
    ["reason"],
)
