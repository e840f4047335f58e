"""``orpheus-serve bench engine``: its statistics, its variants, and one real run on the tiny
model (CPU, tiny N) checked for the JSON's shape and sanity."""

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

from bench.doubles.tiny_model import write_tiny_model
from bench.engine import (
    Level,
    first_wave_lengths,
    intervals_ms,
    not_applicable,
    parse_streams,
    parse_variants,
    quantile,
    summarize,
    variant_overrides,
)
from llm_worker.engine import OutputLoopHook

LEVEL_KEYS = {
    "variant", "streams", "step_ms_p50", "step_ms_p99", "engine_cpu_ms_per_step",
    "gpu_busy_fraction", "tokens_per_s",
}  # fmt: skip


def test_quantile_interpolates_between_order_statistics() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([1.0, 2.0, 3.0, 4.0], 1.0) == 4.0
    assert quantile([5.0], 0.99) == 5.0
    assert quantile(list(range(101)), 0.99) == pytest.approx(99.0)
    with pytest.raises(ValueError):
        quantile([], 0.5)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 1))
def test_quantile_lies_within_the_values(values: list[float], q: float) -> None:
    assert min(values) <= quantile(values, q) <= max(values)


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


def test_summarize_a_window() -> None:
    stamps = [10.0 + 0.01 * i for i in range(101)]  # 100 steps of 10 ms
    stamps[50] += 0.005  # one step of 15 ms, then one of 5 ms
    level = summarize("full-head", 64, stamps, tokens=6400, engine_cpu_s=0.5, gpu_busy=None)
    assert isinstance(level, Level)
    assert level.step_ms_p50 == pytest.approx(10.0)
    assert 10.0 < level.step_ms_p99 <= 15.0
    assert level.engine_cpu_ms_per_step == pytest.approx(5.0)
    assert level.tokens_per_s == pytest.approx(6400.0)
    assert level.gpu_busy_fraction is None
    with pytest.raises(ValueError):
        summarize("x", 1, [1.0], 1, None, None)


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
@pytest.mark.timeout(1200)
def test_bench_engine_runs_on_the_tiny_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    write_tiny_model(model)
    out = tmp_path / "engine.json"
    png = tmp_path / "engine.png"
    argv = [
        sys.executable, "-m", "orpheus_serve", "bench", "engine", "--model", str(model),
        "--device", "cpu", "--streams", "2,4", "--steps", "20", "--tokens", "24",
        "--variants", "full-head,kv-fp8", "--json", str(out), "--png", str(png),
    ]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1100, env=os.environ)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "engine"
    assert {"cpu_model", "cores"} <= doc["machine"].keys()
    assert {"vllm", "torch", "git_commit"} <= doc["versions"].keys()
    assert "commit" in doc
    status = {v["variant"]: v["status"] for v in doc["variants"]}
    assert status == {"full-head": "ok", "kv-fp8": "skipped"}
    levels = doc["levels"]
    assert [(lv["variant"], lv["streams"]) for lv in levels] == [
        ("full-head", 2),
        ("full-head", 4),
    ]
    for lv in levels:
        assert set(lv) == LEVEL_KEYS
        assert 0 < lv["step_ms_p50"] <= lv["step_ms_p99"]
        assert lv["tokens_per_s"] > 0
        assert lv["engine_cpu_ms_per_step"] is not None and lv["engine_cpu_ms_per_step"] >= 0
        assert lv["gpu_busy_fraction"] is None
    assert png.stat().st_size > 0
    assert "kv-fp8: skipped" in proc.stdout


def test_a_variant_refuses_the_wrong_head() -> None:
    from bench.engine import check_head
    from llm_worker import tokens as T
    from llm_worker.output_head import HeadChoice, TokenSpace

    with pytest.raises(RuntimeError, match="full-head: the engine would run"):
        check_head("full-head", HeadChoice(TokenSpace.audio(T.VOCAB_SIZE), "configured"))
    with pytest.raises(RuntimeError, match="audio-head: the engine would run"):
        check_head("audio-head", HeadChoice(TokenSpace.full(), "configured"))
    check_head("stats-off", HeadChoice(TokenSpace.full(), "configured"))


def test_levers_can_sit_on_the_audio_head() -> None:
    from bench.engine import check_head
    from llm_worker import tokens as T
    from llm_worker.output_head import HeadChoice, TokenSpace

    assert variant_overrides("stats-off", "audio") == {
        "output_head": "audio",
        "engine_stats": False,
    }
    assert variant_overrides("full-head", "audio") == {"output_head": "full"}
    audio = HeadChoice(TokenSpace.audio(T.VOCAB_SIZE), "configured")
    with pytest.raises(RuntimeError, match="stats-off: the engine would run"):
        check_head("stats-off", HeadChoice(TokenSpace.full(), "configured"), "audio")
    check_head("stats-off", audio, "audio")
