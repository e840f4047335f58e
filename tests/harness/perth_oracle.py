"""The watermark tests' oracle: resemble-perth's own detector, run in its own environment.

``PerthImplicitWatermarker.get_watermark`` imports librosa and torchaudio, which the server's
environment must not hold, so ``scripts/perth_oracle/score.py`` runs in ``.venv-perth``
(``make perth-oracle`` builds it; ``make test`` depends on it) as a subprocess, once per
call over all the files given: its start (~15 s, librosa and torch) dominates.
"""

from __future__ import annotations

import json
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-perth" / "bin" / "python"
SCRIPT = ROOT / "scripts" / "perth_oracle" / "score.py"
MARKED = 0.9
"""PerTh's reading of marked audio: at least this (its CLI rounds it to 1)."""
UNMARKED = 0.1


def require_oracle() -> None:
    if not (ROOT / ".venv-perth" / ".installed").exists():
        pytest.skip("PerTh's own detector is not installed: `make perth-oracle` (.venv-perth/)")


def write_wav(path: Path, pcm: np.ndarray, rate: int) -> Path:
    """16-bit mono WAV of ``pcm`` (int16, or float in [-1, 1])."""
    a = np.asarray(pcm)
    if a.dtype != np.int16:
        a = np.clip(np.round(a * 32767.0), -32768, 32767).astype(np.int16)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(a.astype("<i2").tobytes())
    return path


def perth_scores(paths: list[Path], timeout_s: float = 240.0) -> dict[str, float]:
    """PerTh's unrounded confidence for each file, by path."""
    require_oracle()
    r = subprocess.run(
        [str(PYTHON), str(SCRIPT), *map(str, paths)],
        capture_output=True, text=True, timeout=timeout_s,
    )  # fmt: skip
    assert r.returncode == 0, f"the PerTh oracle failed: {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {p: v["score"] for p, v in out.items()}
