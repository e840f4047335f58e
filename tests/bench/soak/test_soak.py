"""`bench soak` against the real gateway (synthetic backend at real-time pace): every scenario
runs and ends as it should, floods past admission are refused with Retry-After, nothing hangs,
and the report (table, JSON, PNG) is complete. The soak of the real server is a benchmark
(docs/results/soak_cpu.json), not a test."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
import pytest
from gateway_harness import running_gateway

from bench.soak.cli import build_parser
from bench.soak.cli import main as soak_main
from bench.soak.clients import Soak
from bench.soak.report import build_report, plot_report, print_report
from bench.soak.results import EXPECTED, SCENARIOS, SoakReport
from shm.layout import InstanceLayout

pytestmark = pytest.mark.timeout(120)


async def test_soak_mix_through_the_gateway(
    layout: InstanceLayout, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with running_gateway(
        layout, backend={"realtime": True}, max_active_streams=4, max_queued_streams=2
    ) as h:
        args = build_parser().parse_args(
            ["--url", h.url, "--pid", str(os.getpid()), "--duration", "12", "--users", "3",
             "--flood-size", "16", "--flood-every", "4", "--interval", "3", "--settle-s", "0.5",
             "--min-frames", "3", "--max-frames", "8", "--hang-s", "10", "--seed", "1"]
        )  # fmt: skip
        # This test process stands in for the orchestrator: the samples measure it.
        soak = Soak(args, h.url, f"orpheus-{os.getpid()}")
        start, end = await soak.run()
    report = build_report(soak, start, end)
    print_report(report)
    out = capsys.readouterr().out
    assert "hung: 0" in out and "p99 TTFB over time" in out

    ran = {name for name, counts in report.outcomes.items() if sum(counts.values())}
    assert ran == {*SCENARIOS, "flood"}, report.outcomes
    assert report.hung == 0
    assert report.failures == [], report.failures
    flood = report.outcomes["flood"]
    assert flood["refused"] > 0, "a flood past admission is refused (429 with Retry-After)"
    assert flood["ok"] > 0
    assert report.outcomes["bad_request"]["rejected"] == sum(
        report.outcomes["bad_request"].values()
    )
    assert report.outcomes["complete"]["ok"] > 0
    assert report.outcomes["ws_cancel"]["cancelled"] > 0
    assert len(report.samples) >= 3 and any(s.ttfb_p99_s for s in report.samples)
    assert start.processes and start.processes[0].pid == os.getpid() and start.fds > 0
    for s in soak.streams:
        assert s.outcome in EXPECTED[s.scenario]

    path = tmp_path / "soak.json"
    path.write_bytes(msgspec.json.encode(report))
    back = msgspec.json.decode(path.read_bytes(), type=SoakReport)
    assert back.outcomes == report.outcomes and back.growth.keys() == {"rss_mb", "fds", "shm_mb"}
    png = tmp_path / "soak.png"
    plot_report(report, png)
    assert png.stat().st_size > 10_000


def test_soak_url_needs_the_orchestrator_pid(capsys: pytest.CaptureFixture[str]) -> None:
    assert soak_main(["--url", "http://127.0.0.1:9", "--duration", "1"]) == 2
    assert "--pid" in capsys.readouterr().err
