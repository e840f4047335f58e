"""`orpheus-serve bench gateway` runs end to end at a tiny scale and writes its JSON
(no timing is asserted: numbers from a shared machine are a report, not a test)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.gateway.cpu import main

pytestmark = pytest.mark.timeout(120)


def test_bench_gateway_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    argv = ["--levels", "4,8", "--duration", "1", "--ramp", "0.3", "--warmup", "0.5",
            "--audio-seconds", "1", "--client-procs", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert [lv["streams"] for lv in report["levels"]] == [4, 8]
    for lv in report["levels"]:
        assert lv["errors"] == 0, lv["error_samples"]
        assert lv["chunks"] > 0 and lv["requests_completed"] > 0
        assert lv["p99_lag_ms"] >= lv["p50_lag_ms"] > 0
        assert lv["cpu_ms_per_stream_s"] > 0
        assert 0 <= lv["steal_pct_gateway_cores"] <= 100 and 0 <= lv["steal_pct_all_cores"] <= 100
    assert report["machine"]["cores"] and report["config"]["chunk_bytes"] == 4096
    assert report["versions"]["git_dirty"] in (True, False, None)
    if report["machine"]["cores"] >= 2:  # the gateway has a core to itself, the load the rest
        gw, others = report["machine"]["gateway_cores"], report["machine"]["load_generator_cores"]
        assert len(gw) == 1 and not set(gw) & set(others)


def test_bench_gateway_runs_tracing_off_and_on_side_by_side(tmp_path: Path) -> None:
    """``--tracing off,on``: each mode a run of its own; on exports spans (counted by the
    loopback receiver), off exports none."""
    out = tmp_path / "gateway.json"
    argv = ["--levels", "4", "--duration", "1", "--ramp", "0.3", "--warmup", "0.5",
            "--audio-seconds", "1", "--client-procs", "1", "--tracing", "off,on",
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.read_text())
    off, on = report["levels"]
    assert (off["tracing"], on["tracing"]) == ("off", "on")
    assert off["spans_exported_per_mode"] == 0
    assert on["spans_exported_per_mode"] >= on["requests_completed"] > 0  # one span each
    assert off["errors"] == on["errors"] == 0
    assert "OTEL_SDK_DISABLED" not in os.environ, "the run leaves the environment as it was"


def test_steal_share_is_per_core_set() -> None:
    from bench.gateway.cpu import _steal_pct

    before = {0: (1000, 10), 1: (1000, 0)}
    after = {0: (1100, 30), 1: (1100, 0)}  # core 0: 20 of 100 ticks stolen; core 1: none
    assert _steal_pct(before, after, {0}) == 20.0
    assert _steal_pct(before, after, {1}) == 0.0
    assert _steal_pct(before, after, None) == 10.0


def test_bench_protocols_smoke(tmp_path: Path) -> None:
    """`orpheus-serve bench protocols` at a tiny scale: every protocol gets audio, and no
    first byte comes before the synthetic backend's first chunk."""
    from bench.gateway.protocols import PROTOCOLS
    from bench.gateway.protocols import main as protocols_main

    out = tmp_path / "protocols.json"
    # One level of two sessions: a level's sessions run concurrently, and each protocol's
    # round plays its audio in real time (the synthetic backend), so each level costs seconds.
    argv = ["--levels", "2", "--rounds", "1", "--first-chunk-ms", "30", "--json", str(out)]
    assert protocols_main(argv) == 0
    report = json.loads(out.read_text())
    rows = report["results"]
    assert [(r["protocol"], r["sessions"]) for r in rows] == [(p, 2) for p in PROTOCOLS]
    for r in rows:
        assert r["n"] == r["sessions"] and r["max_ms"] >= r["p50_ms"] >= 30
    assert all(r["p50_vs_openai_http"] > 0 for r in rows)
