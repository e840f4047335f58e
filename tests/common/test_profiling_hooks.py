"""The workers' profiling hooks: armed by ORPHEUS_PROFILE_DIR, one capture per new trigger,
a `.done` file per capture (docs/gpu.md "Profiling hooks")."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import msgspec
import pytest
import torch

from common.profiling import ProfileDone, ProfileTrigger


def _touch_trigger(directory: Path, label: str, mtime: float) -> None:
    path = directory / "trigger"
    path.write_text(label)
    os.utime(path, (mtime, mtime))


def test_unarmed_without_the_variable(tmp_path: Path) -> None:
    assert ProfileTrigger.from_env("codec", {}) is None
    assert ProfileTrigger.from_env("codec", {"ORPHEUS_PROFILE_SECONDS": "2"}) is None


@pytest.mark.parametrize("seconds", ["abc", "0", "-1"])
def test_bad_seconds_is_a_clear_error(tmp_path: Path, seconds: str) -> None:
    env = {"ORPHEUS_PROFILE_DIR": str(tmp_path), "ORPHEUS_PROFILE_SECONDS": seconds}
    with pytest.raises(ValueError, match="ORPHEUS_PROFILE_SECONDS"):
        ProfileTrigger.from_env("codec", env)


def test_each_new_trigger_fires_once_and_an_old_one_never(tmp_path: Path) -> None:
    _touch_trigger(tmp_path, "before-start", 1_000.0)
    t = ProfileTrigger.from_env("llm", {"ORPHEUS_PROFILE_DIR": str(tmp_path)})
    assert t is not None and t.seconds == 3.0 and t.directory == tmp_path
    assert t.poll() is None, "a trigger older than the worker is not a request"
    _touch_trigger(tmp_path, "bf16-c320", 2_000.0)
    assert t.poll() == "bf16-c320"
    assert t.poll() is None, "one capture per trigger"
    _touch_trigger(tmp_path, "", 3_000.0)
    assert t.poll() == "trigger-3000", "an empty trigger still fires, with a made-up label"


def test_done_file_is_json_profile_done(tmp_path: Path) -> None:
    t = ProfileTrigger(tmp_path, 1.0, "codec")
    (tmp_path / "x.pt.trace.json.gz").write_bytes(b"x")
    path = t.write_done("lbl", 0.0, t.files_since(0.0))
    assert path.name == f"codec-{os.getpid()}.done"
    done = msgspec.json.decode(path.read_bytes(), type=ProfileDone)
    assert done.label == "lbl" and done.error == "" and done.role == "codec"
    assert done.files == [str(tmp_path / "x.pt.trace.json.gz")], "the .done file is not a trace"


def test_codec_capture_writes_a_trace_with_the_worker_ranges(tmp_path: Path) -> None:
    from codec_worker.decoder import WindowDecoder
    from codec_worker.engine import DecodeEngine
    from codec_worker.profiling import CodecProfiler
    from codec_worker.snac_model import load_snac
    from common.config.codec import CodecConfig
    from testkit.tiny_model import write_random_snac

    snac = write_random_snac(tmp_path / "snac", seed=1)
    cfg = CodecConfig(model=str(snac), compile=False)
    engine = DecodeEngine.for_config(WindowDecoder(load_snac(str(snac))), cfg, torch.device("cpu"))
    trigger = ProfileTrigger(tmp_path / "prof", 1.0, "codec")
    trigger.directory.mkdir()
    profiler = CodecProfiler(trigger, engine)
    profiler.check_trigger()
    assert not engine.profiling, "no trigger, no capture"
    _touch_trigger(trigger.directory, "unit", 5_000.0)
    profiler.check_trigger()
    assert engine.profiling and profiler.until < float("inf")
    engine.warmup()  # decodes every hot shape through submit()
    profiler.finish()
    assert not engine.profiling
    done = msgspec.json.decode(
        (trigger.directory / f"codec-{os.getpid()}.done").read_bytes(), type=ProfileDone
    )
    assert done.error == "" and done.label == "unit" and len(done.files) == 1
    with gzip.open(done.files[0]) as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert {"codec.gather", "codec.d2h"} <= names
    assert any(n.startswith("codec.decode[") for n in names)
