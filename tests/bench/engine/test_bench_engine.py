"""``orpheus-serve bench engine``: its statistics, its variants, the engines dimension, and
one real run on the tiny model (CPU, tiny N, K = 1 and 2, phase timers on) checked for the
JSON's shape and sanity."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.engine.levels import combine, first_wave_lengths, intervals_ms, shares, summarize_engine
from bench.engine.results import EngineLevel, Level
from bench.engine.variants import (
    engine_config,
    engine_cores,
    not_applicable,
    parse_engines,
    parse_streams,
    parse_variants,
    variant_overrides,
)
from llm_worker.engine.step_hooks import OutputLoopHook
from testkit.tiny_model import write_tiny_model

LEGACY_LEVEL_KEYS = {
    "variant", "streams", "step_ms_p50", "step_ms_p99", "engine_cpu_ms_per_step",
    "gpu_busy_fraction", "tokens_per_s",
}  # fmt: skip
"""A level's fields before the engines dimension: readers of older files rely on them."""
LEVEL_KEYS = LEGACY_LEVEL_KEYS | {"engines", "mps", "per_engine", "phases_us_per_request_step"}


def test_intervals_are_milliseconds_between_signals() -> None:
    assert intervals_ms([1.0, 1.01, 1.03]) == pytest.approx([10.0, 20.0])
    assert intervals_ms([1.0]) == []


@given(st.integers(1, 500), st.integers(1, 2000))
def test_first_wave_ends_evenly_over_one_generation(streams: int, tokens: int) -> None:
    lengths = first_wave_lengths(streams, tokens)
    assert len(lengths) == streams
    assert lengths == sorted(lengths)
    assert lengths[-1] == tokens
    assert min(lengths) >= 1
    # consecutive streams end at most ceil(tokens / streams) steps apart
    gaps = [b - a for a, b in itertools.pairwise(lengths)]
    assert all(0 <= g <= -(-tokens // streams) for g in gaps)


def test_summarize_an_engine_window() -> None:
    stamps = [10.0 + 0.01 * i for i in range(101)]  # 100 steps of 10 ms
    stamps[50] += 0.005  # one step of 15 ms, then one of 5 ms
    e = summarize_engine(0, 64, stamps, 6400, 1.0, engine_cpu_s=0.5, frontend_cpu_s=0.2)
    assert isinstance(e, EngineLevel)
    assert e.step_ms_p50 == pytest.approx(10.0)
    assert 10.0 < e.step_ms_p99 <= 15.0
    assert e.engine_cpu_ms_per_step == pytest.approx(5.0)
    assert e.frontend_cpu_ms_per_step == pytest.approx(2.0)
    assert e.tokens_per_s == pytest.approx(6400.0)
    assert e.steps == 100 and e.phases_us_per_request_step is None
    with pytest.raises(ValueError):
        summarize_engine(0, 1, [1.0], 1, 1.0, None, 0.0)


def _engine_level(i: int, streams: int, p50: float, p99: float, cpu: float | None, tps: float,
                  phases: dict[str, float] | None = None) -> EngineLevel:  # fmt: skip
    return EngineLevel(
        engine=i, streams=streams, steps=100, step_ms_p50=p50, step_ms_p99=p99,
        engine_cpu_ms_per_step=cpu, tokens=int(tps), tokens_per_s=tps,
        frontend_cpu_ms_per_step=1.0, phases_us_per_request_step=phases,
    )  # fmt: skip


def test_a_level_of_several_engines_is_paced_by_the_slowest() -> None:
    a = _engine_level(0, 108, 9.0, 11.0, 8.0, 12000.0, {"schedule": 10.0, "serialize": 2.0})
    b = _engine_level(1, 108, 9.5, 10.5, 9.0, 11000.0, {"schedule": 12.0})
    level = combine("audio-head", [a, b], gpu_busy=0.9, mps=True)
    assert isinstance(level, Level)
    assert (level.streams, level.engines, level.mps) == (216, 2, True)
    assert (level.step_ms_p50, level.step_ms_p99) == (9.5, 11.0)
    assert level.engine_cpu_ms_per_step == pytest.approx(8.5)
    assert level.tokens_per_s == pytest.approx(23000.0)
    assert level.gpu_busy_fraction == 0.9
    assert level.phases_us_per_request_step == {"schedule": 11.0}  # what every engine has
    assert level.per_engine == [a, b]
    one = combine("audio-head", [a], None, None)
    assert (one.step_ms_p50, one.engine_cpu_ms_per_step, one.tokens_per_s) == (9.0, 8.0, 12000.0)
    assert one.phases_us_per_request_step == {"schedule": 10.0, "serialize": 2.0}
    no_cpu = combine("x", [a, _engine_level(1, 1, 1.0, 1.0, None, 1.0)], None, None)
    assert no_cpu.engine_cpu_ms_per_step is None and no_cpu.phases_us_per_request_step is None
    with pytest.raises(ValueError):
        combine("x", [], None, None)


@given(st.integers(1, 2000), st.integers(1, 8))
def test_streams_split_evenly_over_the_engines(streams: int, engines: int) -> None:
    if streams < engines:
        with pytest.raises(ValueError):
            shares(streams, engines)
        return
    s = shares(streams, engines)
    assert len(s) == engines and sum(s) == streams and max(s) - min(s) <= 1 and min(s) >= 1


def test_each_engine_gets_its_share_of_the_device_as_in_the_server() -> None:
    """The bench's engine is configured as one of the server's K engines: the server's
    ``engine_args`` splits the device, the server's CPU plan the cores."""
    from llm_worker.engine.args import engine_args

    def args(device: str, engines: int) -> SimpleNamespace:
        return SimpleNamespace(model="m", engine_count=engines, tokens=100, lever_head="full",
                               device=device)  # fmt: skip

    one = engine_args(engine_config(args("cuda", 1), "full-head", 4), "cuda", [])
    half = engine_args(engine_config(args("cuda", 2), "full-head", 4), "cuda", [])
    assert half.gpu_memory_utilization == pytest.approx(one.gpu_memory_utilization / 2)
    assert half.kv_cache_memory_bytes is None and half.max_num_seqs == 4
    cpu = engine_args(engine_config(args("cpu", 2), "full-head", 4), "cpu", [])
    alone = engine_args(engine_config(args("cpu", 1), "full-head", 4), "cpu", [])
    assert cpu.kv_cache_memory_bytes == alone.kv_cache_memory_bytes  # follows max_num_seqs
    assert engine_cores([0, 1], 2) == ["0", "1"]
    assert engine_cores([3, 2, 1, 0], 2) == ["0,1", "2,3"]
    assert engine_cores([0, 1, 2], 2) == ["0", "1,2"]
    assert engine_cores([0], 2) == ["0", "0"]
    assert engine_cores(range(8), 3) == ["0,1", "2,3", "4,5,6,7"]  # the server's split


def test_variants_change_one_thing_from_the_full_head() -> None:
    full = variant_overrides("full-head")
    assert full == {"output_head": "full"}
    assert variant_overrides("audio-head") == {"output_head": "audio"}
    for name, change in (
        ("top-p-off", {"sampling": {"top_p": 1.0}}),
        ("prefix-cache-off", {"enable_prefix_caching": False}),
        ("stats-off", {"engine_stats": False}),
        ("kv-fp8", {"kv_cache_dtype": "fp8"}),
    ):
        assert variant_overrides(name) == {**full, **change}
    with pytest.raises(ValueError, match="unknown variant"):
        variant_overrides("fast")


def test_parse_flags() -> None:
    assert parse_engines("1,2,3") == [1, 2, 3]
    for bad in ("", "0", "9", "1,1", "x"):
        with pytest.raises(ValueError):
            parse_engines(bad)
    assert parse_variants("full-head, audio-head") == ["full-head", "audio-head"]
    assert parse_streams("64,96,128") == [64, 96, 128]
    for bad in ("full-head,full-head", "full-head,nope"):
        with pytest.raises(ValueError):
            parse_variants(bad)
    for bad in ("", "0,4", "a,b"):
        with pytest.raises(ValueError):
            parse_streams(bad)


def test_kv_fp8_is_skipped_on_cpu_with_a_reason() -> None:
    assert not_applicable("kv-fp8", "cpu")
    assert not_applicable("kv-fp8", "cuda") is None
    assert not_applicable("stats-off", "cpu") is None


async def test_output_loop_hook_signals_before_each_fetch() -> None:
    """With stats off, the step signal comes from the output handler's loop: each call for
    the next step's outputs first signals that the previous step was delivered."""
    events: list[str] = []

    async def fetch() -> str:
        events.append("fetch")
        return "outputs"

    llm = SimpleNamespace(engine_core=SimpleNamespace(get_output_async=fetch))
    OutputLoopHook.install(llm, lambda: events.append("step"))  # type: ignore[arg-type]
    assert await llm.engine_core.get_output_async() == "outputs"
    assert await llm.engine_core.get_output_async() == "outputs"
    assert events == ["step", "fetch", "step", "fetch"]
    await asyncio.sleep(0)


@pytest.mark.slow
@pytest.mark.engine
@pytest.mark.timeout(1500)
def test_bench_engine_runs_one_and_two_engines_on_the_tiny_model(tmp_path: Path) -> None:
    """K = 1 and K = 2 at the same total N, with the phase timers on: the per-phase host
    time comes back from the engine's vLLM processes through the plugin, each phase positive
    and their sum below the step time."""
    model = tmp_path / "model"
    write_tiny_model(model)
    out = tmp_path / "engine.json"
    png = tmp_path / "engine.png"
    argv = [
        sys.executable, "-m", "orpheus_serve", "bench", "engine", "--model", str(model),
        "--device", "cpu", "--streams", "2,4", "--steps", "20", "--tokens", "24",
        "--engines", "1,2", "--variants", "full-head,kv-fp8", "--json", str(out),
        "--png", str(png),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1400, env=os.environ)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "engine"
    assert {"cpu_model", "cores"} <= doc["machine"].keys()
    assert {"vllm", "torch", "git_commit"} <= doc["versions"].keys()
    assert "commit" in doc and doc["config"]["engines"] == [1, 2]
    status = {(v["variant"], v["engines"]): v["status"] for v in doc["variants"]}
    assert status == {
        ("full-head", 1): "ok", ("full-head", 2): "ok",
        ("kv-fp8", 1): "skipped", ("kv-fp8", 2): "skipped",
    }  # fmt: skip
    levels = doc["levels"]
    assert [(lv["variant"], lv["engines"], lv["streams"]) for lv in levels] == [
        ("full-head", 1, 2), ("full-head", 1, 4), ("full-head", 2, 2), ("full-head", 2, 4),
    ]  # fmt: skip
    for lv in levels:
        assert set(lv) == LEVEL_KEYS
        assert 0 < lv["step_ms_p50"] <= lv["step_ms_p99"]
        assert lv["tokens_per_s"] > 0
        assert lv["engine_cpu_ms_per_step"] is not None and lv["engine_cpu_ms_per_step"] >= 0
        assert lv["gpu_busy_fraction"] is None and lv["mps"] is None
        engines = lv["per_engine"]
        assert [e["engine"] for e in engines] == list(range(lv["engines"]))
        assert sum(e["streams"] for e in engines) == lv["streams"]
        assert lv["step_ms_p50"] == max(e["step_ms_p50"] for e in engines)
        assert lv["tokens_per_s"] == pytest.approx(sum(e["tokens_per_s"] for e in engines))
        for e in engines:
            assert e["steps"] >= 20
            phases = e["phases_us_per_request_step"]
            assert phases, e
            assert {"schedule", "update_from_output", "runner_prepare_inputs"} <= phases.keys()
            assert all(us > 0 for us in phases.values()), phases
            # every phase's time is part of a step: per step, their sum is below it
            assert sum(phases.values()) * e["streams"] / 1e3 < e["step_ms_p50"], e
    assert png.stat().st_size > 0
    assert "kv-fp8 K=1: skipped" in proc.stdout
    assert "µs per request-step" in proc.stdout


def test_a_variant_refuses_the_wrong_head() -> None:
    from bench.engine.variants import check_head
    from llm_worker.engine.output_head import HeadChoice
    from llm_worker.vllm_ext import tokens as T
    from llm_worker.vllm_ext.token_space import TokenSpace

    with pytest.raises(RuntimeError, match="full-head: the engine would run"):
        check_head("full-head", HeadChoice(TokenSpace.audio(T.VOCAB_SIZE), "configured"))
    with pytest.raises(RuntimeError, match="audio-head: the engine would run"):
        check_head("audio-head", HeadChoice(TokenSpace.full(), "configured"))
    check_head("stats-off", HeadChoice(TokenSpace.full(), "configured"))


def test_levers_can_sit_on_the_audio_head() -> None:
    from bench.engine.variants import check_head
    from llm_worker.engine.output_head import HeadChoice
    from llm_worker.vllm_ext import tokens as T
    from llm_worker.vllm_ext.token_space import TokenSpace

    assert variant_overrides("stats-off", "audio") == {
        "output_head": "audio",
        "engine_stats": False,
    }
    assert variant_overrides("full-head", "audio") == {"output_head": "full"}
    audio = HeadChoice(TokenSpace.audio(T.VOCAB_SIZE), "configured")
    with pytest.raises(RuntimeError, match="stats-off: the engine would run"):
        check_head("stats-off", HeadChoice(TokenSpace.full(), "configured"), "audio")
    check_head("stats-off", audio, "audio")
