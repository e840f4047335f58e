"""`orpheus-serve bench gateway` runs end to end at a tiny scale and writes its JSON
(no timing is asserted: numbers from a shared machine are a report, not a test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.bench import main

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
    assert report["machine"]["cores"] and report["config"]["chunk_bytes"] == 4096
