"""The project's wheel carries what a clean install needs beyond its modules: the vLLM
plugin entry point that registers the audio head's model class, and the engine's empty
generation config (package data). The GPU recipe installs this wheel (scripts/gpu)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from llm_worker.engine.output_head import PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_TARGET

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("orpheus_serve", "bench", "testkit", "orchestrator", "orpheus_client", "llm_worker",
            "codec_worker", "gateway", "common", "store", "shm", "orpheus_wire")  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # A copy of what the build reads: setuptools builds in the source tree (build/, egg-info).
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=skip)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(src)],
        check=True, cwd=src, capture_output=True,
    )  # fmt: skip
    (whl,) = out.glob("orpheus_serve-*.whl")
    return whl


def test_the_wheel_registers_the_vllm_plugin(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (eps,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = z.read(eps).decode()
    section = text.split(f"[{PLUGIN_GROUP}]", 1)[1].split("[", 1)[0]
    assert f"{PLUGIN_NAME} = {PLUGIN_TARGET}" in section


def test_the_wheel_carries_the_model_class_and_the_generation_config(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        assert z.read("llm_worker/engine/generation_config/generation_config.json").strip() == b"{}"
    assert {"llm_worker/vllm_ext/audio_head_model.py", "llm_worker/vllm_ext/plugin.py"} <= names
