"""How ``bench compare`` turns the two servers' levels into ratios (hand-computed)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.compare.cli import build_parser, server_for
from bench.compare.comparison import VariantRun, compare_capacity, compare_levels
from bench.load.summary import LevelResult, LevelRun, Slo, summarize
from bench.load.trace import Outcome, StreamTrace

SLO = Slo(ttfb_s=1.0, ttfb_report_s=(0.5,), jitter_buffer_s=0.1)


def level(concurrency: int, audio_s: float, rtf: float) -> LevelResult:
    """One measured 1 s stream of audio ``audio_s`` seconds; 10 s window -> audio_s / 10."""
    nbytes = int(audio_s * 48_000)
    t = StreamTrace(index=0, kind="short", chars=30, scheduled=0.0, measured=True)
    t.sent = 0.0
    t.record(0.2, nbytes // 2)
    t.record(rtf * audio_s, nbytes - nbytes // 2)
    t.outcome, t.status, t.done = Outcome.OK, 200, rtf * audio_s
    run = LevelRun(
        mode="closed",
        concurrency=concurrency,
        started=0.0,
        measure_start=0.0,
        measure_end=10.0,
        finished=10.0,
        traces=[t],
    )
    return summarize(run, SLO)


def run(variant: str, rnd: int, levels: list[LevelResult]) -> VariantRun:
    return VariantRun(variant=variant, round=rnd, ready_after_s=1.0, levels=levels, log="x")  # type: ignore[arg-type]


def test_ratio_of_audio_seconds_per_second_at_equal_concurrency() -> None:
    runs = [
        run("baseline", 1, [level(8, 2.0, 3.0), level(32, 2.0, 5.0)]),
        run("ours", 1, [level(8, 5.0, 1.5), level(32, 6.0, 1.5)]),
    ]
    c8, c32 = compare_levels(runs, [8, 32])
    assert (c8.concurrency, c8.baseline_audio_s_per_s, c8.ours_audio_s_per_s) == (
        8,
        pytest.approx(0.2),
        pytest.approx(0.5),
    )
    assert c8.ratio == pytest.approx(2.5)
    assert c32.ratio == pytest.approx(3.0)


def test_rounds_take_the_median_ratio() -> None:
    runs = [
        run("baseline", 1, [level(8, 2.0, 3.0)]),
        run("ours", 1, [level(8, 4.0, 1.5)]),  # 2.0x
        run("ours", 2, [level(8, 3.0, 1.5)]),
        run("baseline", 2, [level(8, 1.0, 3.0)]),  # 3.0x
        run("baseline", 3, [level(8, 2.0, 3.0)]),
        run("ours", 3, [level(8, 5.0, 1.5)]),  # 2.5x
    ]
    (c8,) = compare_levels(runs, [8])
    assert c8.round_ratios == [pytest.approx(2.0), pytest.approx(3.0), pytest.approx(2.5)]
    assert c8.ratio == pytest.approx(2.5)


def test_missing_level_gives_no_ratio() -> None:
    runs = [run("baseline", 1, [level(8, 2.0, 3.0)]), run("ours", 1, [])]
    (c8,) = compare_levels(runs, [8])
    assert c8.ratio is None and math.isnan(c8.ours_audio_s_per_s)


def test_capacity_from_the_levels_run() -> None:
    runs = [
        run("baseline", 1, [level(8, 2.0, 0.5), level(32, 2.0, 1.5)]),  # passes at 8 only
        run("ours", 1, [level(8, 2.0, 0.5), level(32, 2.0, 0.6)]),  # passes at both
    ]
    cap = compare_capacity(runs, SLO)
    assert (cap.method, cap.baseline, cap.ours, cap.ratio) == ("levels", 8, 32, 4.0)


def test_capacity_ratio_is_undefined_when_the_baseline_has_none() -> None:
    runs = [run("baseline", 1, [level(8, 2.0, 5.0)]), run("ours", 1, [level(8, 2.0, 0.5)])]
    cap = compare_capacity(runs, SLO)
    assert (cap.baseline, cap.ours, cap.ratio) == (0, 8, None)


def test_both_servers_get_the_shared_configuration(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        [
            "--model", "m", "--codec-model", "m/snac", "--device", "cpu",
            "--set", "llm.max_num_seqs=16", "--config", "c.toml",
            "--serve-arg=--set=codec.max_batch=8", "--baseline-arg=--keep-zero-filter-bug",
            "--log-dir", str(tmp_path),
        ]
    )  # fmt: skip
    base = server_for("baseline", args, 1).argv
    ours = server_for("ours", args, 1).argv
    assert base[1:3] == ["-m", "bench.compare.baseline"] and ours[1] == "serve"
    for argv in (base, ours):
        assert "--set=llm.max_num_seqs=16" in argv
        assert argv[argv.index("--config") + 1] == "c.toml"
        assert argv[argv.index("--model") + 1] == "m"
        assert argv[argv.index("--device") + 1] == "cpu"
    assert "--set=codec.max_batch=8" in ours and "--set=codec.max_batch=8" not in base
    assert "--keep-zero-filter-bug" in base and "--keep-zero-filter-bug" not in ours
