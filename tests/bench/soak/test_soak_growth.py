"""The growth arithmetic of ``bench soak``: the levels of the first and last windows after the
warm-up, the bound, the least-squares slope, and fds and /dev/shm that must stay flat."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.soak.cli import build_parser
from bench.soak.cli import main as soak_main
from bench.soak.growth import check_growth, default_warmup_s, slope_per_hour
from bench.soak.probe_growth import summarize
from bench.soak.results import ProcSample, Sample

MB = 1_000_000


def sample(
    t: float, rss_mb: dict[str, float], *, fds: int = 100, segments: int = 3, shm_mb: float = 72
) -> Sample:
    procs = [ProcSample(n, i + 1, int(v * MB), 10) for i, (n, v) in enumerate(rss_mb.items())]
    return Sample(
        t_s=t,
        processes=procs,
        rss_bytes=sum(p.rss_bytes for p in procs),
        fds=fds,
        shm_bytes=0,
        shm_total_bytes=0,
        shm_segments=segments,
        shm_size_bytes=int(shm_mb * MB),
        streams=0,
        ttfb_p99_s=None,
        ttfb_p50_s=None,
    )


def test_growth_is_judged_from_the_first_sample_after_the_warm_up() -> None:
    # The codec steps up during the warm-up (not judged), then stays flat; the gateway creeps.
    samples = [
        sample(0, {"codec": 450, "gateway": 75}),
        sample(100, {"codec": 800, "gateway": 80}),
        sample(300, {"codec": 1000, "gateway": 82}),
        sample(450, {"codec": 1010, "gateway": 86}),
        sample(600, {"codec": 1004, "gateway": 92}),
    ]
    g = check_growth(samples, 300, bound_pct=2.0, floor_mb=8.0)
    by = {p.name: p for p in g.processes}
    assert g.window_s == 300
    assert (by["codec"].base_mb, by["codec"].end_mb, by["codec"].peak_mb) == (1000, 1004, 1010)
    assert by["codec"].growth_mb == 4 and by["codec"].bound_mb == 20 and by["codec"].ok
    assert by["gateway"].growth_mb == 10 and by["gateway"].bound_mb == 8  # the floor
    assert not by["gateway"].ok and not g.passed
    assert g.problems == ["gateway grew +10.0 MB (+12.2%) after the warm-up; bound 8.0 MB"]
    # 82 -> 86 -> 92 over 300 s: least squares 10 MB per 300 s = 120 MB/h.
    assert by["gateway"].slope_mb_per_h == pytest.approx(120.0)


def test_each_end_is_the_lowest_level_of_its_window_not_one_sample() -> None:
    # vLLM's CPU worker under floods every 30 s (sampled every 10 s): a trough, a flood's
    # high-water, a middle; after the traffic it settles above its troughs (the free heap
    # its trimmer keeps). The first sample after the warm-up is a trough: compared with the
    # settled end alone that was +23 MB, over a 0.5% bound, with nothing growing.
    def worker(t: float, leak_mb_per_s: float = 0.0) -> Sample:
        swing = (0, 65, 30)[int(t // 10) % 3]
        codec = 480 if t < 190 else 486  # a step up that lasts through the last window
        return sample(t, {"worker": 1425 + swing + leak_mb_per_s * t, "codec": codec}, fds=300)

    def run(leak_mb_per_s: float = 0.0) -> list[Sample]:
        settled = {"worker": 1448 + leak_mb_per_s * 230, "codec": 486}
        return [*(worker(t, leak_mb_per_s) for t in range(90, 220, 10)),
                sample(230, settled, fds=298)]  # fmt: skip

    g = check_growth(run(), 90, bound_pct=0.5, floor_mb=4)
    by = {p.name: p for p in g.processes}
    assert g.level_window_s == 35 and g.window_s == 140
    assert (by["worker"].base_mb, by["worker"].end_mb, by["worker"].peak_mb) == (1425, 1425, 1490)
    assert by["codec"].growth_mb == 6 and g.problems == [
        "codec grew +6.0 MB (+1.2%) after the warm-up; bound 4.0 MB"
    ]  # a step in the level is growth
    assert g.fds_growth == -2
    # A process whose level moves by design gets its own floor (``--growth-floor NAME=MB``).
    g = check_growth(run(), 90, bound_pct=0.5, floor_mb=4, floors_mb={"codec": 10})
    assert g.passed and [p.bound_mb for p in g.processes] == [10, 7.1]
    args = ["--url", "http://127.0.0.1:9", "--growth-floor"]
    floors = build_parser().parse_args([*args, "orpheus-serve codec=71"]).growth_floor
    assert floors == [("orpheus-serve codec", 71.0)]
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "71"])
    # A leak raises the troughs too: 0.2 MB/s, from the trough at 90 s to the one at 210 s.
    by = {p.name: p for p in check_growth(run(0.2), 90, bound_pct=0.5, floor_mb=4).processes}
    assert by["worker"].growth_mb == pytest.approx(0.2 * (210 - 90), abs=0.1)
    assert not by["worker"].ok


def test_processes_of_one_name_are_summed_and_fds_and_shm_must_stay_flat() -> None:
    def two(t: float, a: float, b: float, **kw: float) -> Sample:
        s = sample(t, {"x": 0}, **kw)  # type: ignore[arg-type]
        procs = [ProcSample("resource_tracker", 1, int(a * MB), 5),
                 ProcSample("resource_tracker", 2, int(b * MB), 5)]  # fmt: skip
        return Sample(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "processes": procs})

    g = check_growth([two(0, 10, 10), two(10, 10, 13), two(20, 11, 13)], 0, floor_mb=5)
    (rt,) = g.processes
    assert (rt.base_mb, rt.end_mb, rt.growth_mb) == (20, 24, 4) and g.passed
    g = check_growth([sample(0, {"a": 1}), sample(60, {"a": 1}, fds=101, segments=4, shm_mb=80)], 0)
    assert not g.passed and g.fds_growth == 1 and g.shm_segments_growth == 1
    assert g.shm_size_growth_mb == 8
    assert g.problems == [
        "open file descriptors grew by 1 after the warm-up",
        "/dev/shm grew by 1 segment(s), +8.0 MB after the warm-up",
    ]
    # Fewer fds at the end than at warm-up (a flood's sockets closed) is not growth.
    assert check_growth([sample(0, {"a": 1}, fds=300), sample(9, {"a": 1})], 0).passed


def test_shared_ring_pages_are_not_private_growth() -> None:
    # The gateway's RSS rises by 16 MB of ring pages touched (RssShmem): bounded by the ring,
    # judged with /dev/shm; its private RSS is flat.
    def gw(t: float, rss: float, shmem: float) -> Sample:
        s = sample(t, {"x": 0})
        procs = [ProcSample("gateway", 1, int(rss * MB), 40, int(shmem * MB))]
        return Sample(**{**{f: getattr(s, f) for f in s.__struct_fields__}, "processes": procs})

    g = check_growth([gw(0, 94, 1), gw(300, 102, 9), gw(600, 111, 17)], 0)
    assert g.passed and g.processes[0].growth_mb == 1 and g.processes[0].base_mb == 93


def test_too_few_samples_after_the_warm_up_is_an_error() -> None:
    with pytest.raises(ValueError, match="1 sample"):
        check_growth([sample(0, {"a": 1}), sample(10, {"a": 1})], 5)


def test_default_warm_up_is_half_the_run_up_to_15_minutes() -> None:
    assert default_warmup_s(600) == 300 and default_warmup_s(7200) == 900


def test_a_per_stream_leak_of_the_issues_size_fails_the_bound() -> None:
    # ~40 KB per stream (954 MB over 22,454 streams): 400 streams after the warm-up are 16 MB,
    # over the 8 MB floor of a 90 MB gateway.
    per_stream = 40_000 / MB
    samples = [sample(t, {"gateway": 90 + per_stream * 2 * t}) for t in range(0, 400, 15)]
    g = check_growth(samples, 0)
    assert not g.passed and g.processes[0].growth_mb > 8


@given(
    st.floats(-1e4, 1e4, allow_nan=False),
    st.floats(-1e4, 1e4, allow_nan=False),
    st.lists(st.integers(0, 100_000), min_size=2, max_size=30, unique=True),
)
def test_slope_of_a_line_is_its_slope_per_hour(a: float, b: float, ts: list[int]) -> None:
    points = [(t, a + b * t) for t in ts]
    assert math.isclose(slope_per_hour(points), b * 3600, rel_tol=1e-6, abs_tol=1e-3)


def test_slope_of_one_point_or_one_time_is_zero() -> None:
    assert slope_per_hour([(5, 1.0)]) == 0 and slope_per_hour([(5, 1.0), (5, 9.0)]) == 0


# -- what the memory probe saw inside each process (bench soak --profile-memory) -----------------
def probe_record(t: float, anon_mb: float, heap_mb: float, objects: dict[str, int]) -> dict:
    return {
        "t": t,
        "name": "orpheus-serve gateway-0",
        "rollup": {"Private_Clean": 0, "Private_Dirty": int((anon_mb + 5) * MB),
                   "Anonymous": int(anon_mb * MB)},
        "heap_rss": int(heap_mb * MB),
        "malloc": {"uordblks": int(heap_mb * MB * 0.9), "fordblks": int(heap_mb * MB * 0.1),
                   "hblkhd": 0},
        "objects": objects,
        "objects_total": sum(objects.values()),
        "gc": {"collections": [50, 5, 1], "sweeps": {"count": int(t // 60), "max_s": 0.004}},
    }  # fmt: skip


def test_probe_growth_compares_the_between_flood_levels_of_the_first_and_last_windows(
    tmp_path: Path,
) -> None:
    # Before t=100 the warm-up (not judged); after it a flood at every 4th sample raises
    # everything for a moment; the level between floods rises 1 MB in Python's own memory
    # (anonymous outside the heap) while dicts pile up.
    recs = [probe_record(t, 10, 5, {"dict": 10}) for t in range(0, 100, 10)]
    for i, t in enumerate(range(100, 500, 10)):
        flood = 30 if i % 4 == 0 else 0
        level = 40 + (1 if t >= 400 else 0)
        recs.append(probe_record(t, level + flood, 8 + flood, {"dict": 100 + t, "list": 7}))
    path = tmp_path / "4242.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"t": 1, "rol')  # cut line
    [g] = summarize(tmp_path, after_t=100)
    assert g.pid == 4242 and g.name == "orpheus-serve gateway-0" and g.samples == 40
    assert g.window_s == pytest.approx(97.5)
    assert g.mb["anonymous"].base == pytest.approx(40) and g.mb["anonymous"].end == pytest.approx(
        41
    )
    assert g.mb["heap"].growth == pytest.approx(0)
    assert g.mb["other_anonymous"].growth == pytest.approx(1)
    assert g.sweeps == 8 and g.sweep_max_ms == 4.0
    assert g.grown_types == {
        "dict": 590 - 290
    }  # the windows' last samples (t 490, 190) and g.gc_collections == [50, 5, 1]


def test_probe_growth_needs_samples_after_the_warm_up(tmp_path: Path) -> None:
    (tmp_path / "1.jsonl").write_text(json.dumps(probe_record(5, 1, 1, {})) + "\n")
    assert summarize(tmp_path, after_t=0) == []


def test_profile_memory_needs_a_server_the_soak_starts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--url", "http://127.0.0.1:9", "--pid", "1", "--profile-memory", "probe"]
    assert soak_main(argv) == 2
    assert "--profile-memory needs --model" in capsys.readouterr().err
