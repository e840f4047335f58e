"""`orpheus-serve bench ring` runs at a tiny scale, writes its JSON and leaves no ring behind
(no timing is asserted: numbers from a shared machine are a report, not a test)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from bench.ring import KINDS, PACES, main

pytestmark = pytest.mark.timeout(120)


def test_bench_ring_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ring.json"
    assert main(["--records", "40", "--calls", "200", "--repeats", "2", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    cases = [(r["case"], r["rings"], r["pace"]) for r in report["handoff"]]
    assert cases == [(k, n, pace) for pace in PACES for k, n in KINDS]
    for r in report["handoff"]:
        assert r["records"] == 40 and r["p99_us"] >= r["p50_us"] > 0
        assert r["cpu_us_per_record"] > 0
    assert [(r["case"], r["rings"]) for r in report["hit"]] == list(KINDS)
    assert all(r["ns_per_wait"] > 0 and r["ns_per_has_data"] > 0 for r in report["hit"])
    mine = f"orpheus-{os.getpid()}-bring"
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(mine)]
