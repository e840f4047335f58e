"""A soak's results: its scenarios and their expected outcomes, the streams, the samples of
the instance's processes, and the report (its JSON)."""

from __future__ import annotations

import msgspec

from bench.lib.environment import Machine, Versions
from bench.soak.growth import GrowthCheck
from bench.soak.probe_growth import ProbeGrowth

BYTES_PER_FRAME = 2048 * 2
WS_REFUSALS = {"server_busy": 429, "queue_timeout": 429, "draining": 503, "workers_not_ready": 503}
"""Error codes with which the gateway refuses a stream it cannot admit (and their HTTP status)."""
SCENARIOS = {
    "complete": 4,
    "disconnect": 2,
    "ws_cancel": 2,
    "slow_reader": 1,
    "bad_request": 1,
}
SLOW_READ_BYTES = 2048
SLOW_READ_PAUSE_S = 0.1
"""A slow reader takes 20 KB/s: 0.43x the audio's 48 KB/s."""
SETTLE_S = 20.0
"""Traffic stopped, then this long before the end sample: the server finishes what
cancelled and disconnected streams left, and vLLM's CPU processes, which hand free heap
memory back every ``llm.cpu_heap_trim_s`` (15 s), hand back the last flood's."""
OUTCOMES = ("ok", "disconnected", "cancelled", "refused", "rejected", "failed", "hung")


class SoakStream(msgspec.Struct, kw_only=True):
    scenario: str
    started: float
    """Seconds since the soak began."""
    outcome: str = "failed"
    status: int | None = None
    ttfb_s: float | None = None
    audio_bytes: int = 0
    duration_s: float = 0.0
    detail: str = ""


class ProcSample(msgspec.Struct, frozen=True):
    name: str
    pid: int
    rss_bytes: int
    fds: int
    shmem_bytes: int = 0
    """The part of ``rss_bytes`` that is shared memory (the rings' pages this process has
    touched: bounded by the ring sizes, and counted once in the instance's /dev/shm)."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    t_s: float
    processes: list[ProcSample]
    rss_bytes: int
    fds: int
    shm_bytes: int
    """Bytes of the instance's /dev/shm segments and of those its processes map."""
    shm_total_bytes: int
    """All of /dev/shm (machine-wide: other jobs share it)."""
    shm_segments: int = 0
    """How many /dev/shm segments the instance has (its own and those its processes map)."""
    shm_size_bytes: int = 0
    """Their apparent sizes (``shm_bytes`` counts only the pages touched so far)."""
    streams: int
    """Streams started in the interval that ended here."""
    ttfb_p99_s: float | None
    ttfb_p50_s: float | None


class SoakReport(msgspec.Struct, kw_only=True):
    kind: str = "soak"
    created: str
    duration_s: float
    users: int
    flood_size: int
    flood_every_s: float
    hang_s: float
    url: str
    outcomes: dict[str, dict[str, int]]
    """scenario -> outcome -> count."""
    hung: int
    streams: int
    samples: list[Sample]
    start: Sample
    end: Sample
    growth: dict[str, float]
    """end - start: rss_mb, fds, shm_mb (the instance's)."""
    after_warmup: GrowthCheck | None = None
    """Growth per process after the warm-up, with the bounds it was judged by."""
    probe: list[ProbeGrowth] | None = None
    """With ``--profile-memory``: what each process's memory probe saw after the warm-up."""
    failures: list[str]
    """Details of the first streams whose outcome was not the expected one."""
    machine: Machine
    versions: Versions
    note: str = "random weights: the audio is noise; this measures the server, not the voice"


# Any HTTP request may be refused (429/503 with Retry-After) while a flood fills admission.
EXPECTED = {
    "complete": {"ok", "refused"},
    "disconnect": {"disconnected", "ok", "refused"},
    "ws_cancel": {"cancelled", "ok", "refused"},
    "slow_reader": {"ok", "refused"},
    "bad_request": {"rejected", "refused"},  # admission is decided before the voice is read
    "flood": {"ok", "refused"},
}
