"""A short soak of the real server (vLLM on CPU with the tiny model, SNAC's architecture):
every process's private RSS stays flat after a warm-up, fds and /dev/shm do not grow,
nothing hangs or fails (issue 36); the memory probe runs inside each process meanwhile.

The bound is tight enough to see the issue's leak: 954 MB over 22,454 streams is ~40 KB a
stream; the run must serve at least ``FLOOR_MB / 40 KB`` streams after the warm-up (the test
checks it did), so a leak of that size breaks a 0.5% / 4 MB bound in every process, vLLM's
CPU worker included (its growth at floods was glibc's free heap, now handed back:
``llm.cpu_heap_trim_s``).

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

from bench.load.soak import SoakReport
from bench.load.soak import main as soak_main

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]

DURATION_S = 200
WARMUP_S = 90
INTERVAL_S = 10
FLOOR_MB = 4.0
BOUND_PCT = 0.5
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
         "--growth-floor-mb", str(FLOOR_MB), "--json", str(out),
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
        "orpheus-serve codec", "orpheus-serve llm", "VLLM::Worker", "orchestrator"
    }  # fmt: skip
    # Sensitivity: every process of the pipeline served enough streams after the warm-up
    # for a 40 KB-per-stream leak to exceed the floor (refused ones reach the gateway only).
    # A sample counts the streams whose first audio came in the interval it closes.
    served = sum(s.streams for s in report.samples if s.t_s - INTERVAL_S >= WARMUP_S)
    assert served * LEAK_PER_STREAM_MB > FLOOR_MB, f"{served} streams served after the warm-up"
    # The memory probe ran inside every process, the server's workers and vLLM's alike, and
    # the workers' full collections on the clock (common/heap.py) ran while they served.
    assert report.probe is not None and "ORPHEUS_PROFILE_MEMORY" not in os.environ
    probed = {g.name: g for g in report.probe}
    assert set(probed) >= {
        "orpheus-serve gateway-0", "orpheus-serve codec", "orpheus-serve llm", "VLLM::Worker",
        "VLLM::EngineCore",
    }, sorted(probed)  # fmt: skip
    for name in ("orpheus-serve gateway-0", "orpheus-serve codec", "orpheus-serve llm"):
        assert probed[name].sweeps >= 2 and probed[name].mb["uss"].base > 10, probed[name]
