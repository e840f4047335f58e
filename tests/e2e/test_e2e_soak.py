"""A short soak of the real server (vLLM on CPU with the tiny model, SNAC's architecture):
every process's memory stays flat after a warm-up, fds and /dev/shm do not grow, nothing
hangs or fails (issue 36); the memory probe runs inside each process meanwhile.

Memory is judged twice, each by the level between floods (the lowest value in the first and
in the last window after the warm-up; ``bench.soak.growth``, ``bench.soak.probe_growth``):

- *Live memory*, from inside (the probe): what glibc's malloc has in use, in every process of
  the pipeline, within ``LIVE_FLOOR_MB``. The issue's leak was 954 MB over 22,454 streams,
  ~40 KB a stream; the run must serve enough streams after the warm-up for a leak of that
  size to break the bound (the test checks it did). Measured here (eight runs, their JSON in
  docs/results/soak_test_2026-12-02/): every process but the codec within ±0.6 MB; the codec
  +0.3 to +6.7 MB, still filling for the batch shapes
  the floods bring (+0.5 MB between the first and the last half hour of the 2-hour soak's
  judged span), so its bound is ``CODEC_LIVE_FLOOR_MB``.
- *Private RSS*, from outside: within ``RSS_FLOOR_MB`` (or 0.5%), except the codec and vLLM's
  CPU worker (which runs in ``VLLM::EngineCore``: llm_worker.engine.env). Those two hand their
  floods' memory back (``common.host_heap.HeapBound``) but keep free heap between trims, the
  codec up to ``KEEP_FREE_BYTES`` (64 MiB), so their level moves by tens of MB without growing
  (measured with the worker in a process of its own: -13 to +26 MB, its settled level
  1,420-1,455 MB against troughs of 1,421-1,430 under the floods); their floor is that bound.
  The test checks that the codec's flood memory is larger, so keeping it would break it.
  (vLLM's worker kept a flood's free heap in the 2-hour soak of issue 36; in 200 s with its
  trim off it reaches its high-water in the warm-up and stays flat: that is the 2-hour
  benchmark's to see.)

The length is what the memory probe's check of two full collections on the clock needs: a
worker whose first finds nothing waits twice as long for the second (common/heap.py: 60 s,
then 120 s after settling), and the llm worker settles last, when the server is ready, so its
second comes about 180 s into the soak; 200 s and the 20 s the soak waits before its last
sample leave the probe (sampling every ``INTERVAL_S``) time to see it (docs/performance.md,
issue 44).
The 2-hour soak with the issue's 2% bound is a benchmark (docs/benchmarks.md), not a test.
"""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest

from bench.soak.cli import main as soak_main
from bench.soak.results import SoakReport
from common.host_heap import KEEP_FREE_BYTES

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

DURATION_S = 200
WARMUP_S = 90
INTERVAL_S = 10
LIVE_FLOOR_MB = 4.0
CODEC_LIVE_FLOOR_MB = 16.0
RSS_FLOOR_MB = 4.0
HEAP_BOUND_FLOOR_MB = KEEP_FREE_BYTES / 1e6 + RSS_FLOOR_MB
BOUND_PCT = 0.5
PIPELINE = (
    "orpheus-serve gateway-0", "orpheus-serve codec", "orpheus-serve llm", "VLLM::EngineCore",
)  # fmt: skip
HEAP_BOUND = ("orpheus-serve codec", "VLLM::EngineCore")
"""The processes that trim their free heap after floods (common.host_heap.HeapBound)."""
LEAK_PER_STREAM_MB = 0.04
"""The issue's leak: ~1 GB over 22,454 streams."""


def test_short_soak_keeps_every_process_flat(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "soak.json"
    rc = soak_main(
        ["--model", str(tiny_model), "--duration", str(DURATION_S), "--warmup", str(WARMUP_S),
         "--interval", str(INTERVAL_S), "--users", "6", "--flood-every", "30", "--flood-size", "96",
         "--max-frames", "16", "--hang-s", "60", "--growth-bound-pct", str(BOUND_PCT),
         "--growth-floor-mb", str(RSS_FLOOR_MB),
         *(f"--growth-floor={name}={HEAP_BOUND_FLOOR_MB}" for name in HEAP_BOUND), "--json", str(out),
         "--server-log", str(tmp_path / "server.log"), "--profile-memory", str(tmp_path / "probe")]
    )  # fmt: skip
    text = capsys.readouterr().out
    print(text)
    report = msgspec.json.decode(out.read_bytes(), type=SoakReport)
    g = report.after_warmup
    assert g is not None
    assert report.hung == 0 and report.failures == [], report.failures
    assert g.fds_growth <= 0 and g.shm_segments_growth == 0 and g.shm_size_growth_mb == 0
    over = [
        f"{p.name} {p.growth_mb:+.1f} MB ({p.growth_pct:+.1f}%)" for p in g.processes if not p.ok
    ]
    assert not over, over
    assert rc == (0 if g.passed else 1)
    assert {p.name for p in g.processes} >= {
        "orpheus-serve codec", "orpheus-serve llm", "VLLM::EngineCore", "orchestrator"
    }  # fmt: skip
    # Sensitivity: every process of the pipeline served enough streams after the warm-up
    # for a 40 KB-per-stream leak to exceed the live bound of all but the codec (refused
    # ones reach the gateway only; the codec's bound needs four times the streams). A sample
    # counts the streams whose first audio came in the interval it closes.
    served = sum(s.streams for s in report.samples if s.t_s - INTERVAL_S >= WARMUP_S)
    assert served * LEAK_PER_STREAM_MB > LIVE_FLOOR_MB, f"{served} streams after the warm-up"
    # ... and the codec's flood memory, were it kept, would break its RSS bound.
    codec = next(p for p in g.processes if p.name == "orpheus-serve codec")
    assert codec.peak_mb - codec.end_mb > HEAP_BOUND_FLOOR_MB, codec
    # The memory probe ran inside every process, the server's workers and vLLM's alike, and
    # the workers' full collections on the clock (common/heap.py) ran while they served.
    assert report.probe is not None and "ORPHEUS_PROFILE_MEMORY" not in os.environ
    probed = {g.name: g for g in report.probe}
    assert set(probed) >= set(PIPELINE), sorted(probed)
    for name in ("orpheus-serve gateway-0", "orpheus-serve codec", "orpheus-serve llm"):
        assert probed[name].sweeps >= 2 and probed[name].mb["uss"].base > 10, probed[name]
    live = {name: probed[name].mb["malloc_in_use"] for name in PIPELINE}
    floors = {name: LIVE_FLOOR_MB for name in PIPELINE} | {
        "orpheus-serve codec": CODEC_LIVE_FLOOR_MB
    }
    grown = {n: f"{v.base:.1f} -> {v.end:.1f} MB" for n, v in live.items() if v.growth > floors[n]}
    assert not grown, grown
