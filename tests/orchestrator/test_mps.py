"""CUDA MPS detection (common/mps.py) and the orchestrator's start-up line and warning about it
(orchestrator/mps.py), against real named pipes and UNIX sockets in a temporary directory."""

from __future__ import annotations

import logging
import os
import re
import socket
from pathlib import Path

import pytest

from common.config import ServeConfig
from common.config.llm import LLMConfig
from common.mps import DEFAULT_PIPE_DIRECTORY, control_path, mps_active, pipe_directory
from orchestrator.mps import DOCS, log_mps, mps_lines

ROOT = Path(__file__).resolve().parents[2]


def fifo_daemon(directory: Path) -> dict[str, str]:
    """A pipe directory as an older MPS control daemon leaves it: a ``control`` FIFO."""
    directory.mkdir(exist_ok=True)
    os.mkfifo(directory / "control")
    return {"CUDA_MPS_PIPE_DIRECTORY": str(directory)}


def test_the_pipe_directory_is_the_environments_else_the_default(tmp_path: Path) -> None:
    assert pipe_directory({}) == DEFAULT_PIPE_DIRECTORY == "/tmp/nvidia-mps"
    assert pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": ""}) == DEFAULT_PIPE_DIRECTORY
    assert pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == str(tmp_path)
    assert control_path({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == str(tmp_path / "control")


def test_a_control_fifo_means_active(tmp_path: Path) -> None:
    env = fifo_daemon(tmp_path / "mps")
    assert mps_active(env)
    # The same daemon, looked for elsewhere (the default, a sandboxed /tmp): not active.
    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})


def test_a_control_socket_means_active(tmp_path: Path) -> None:
    """Current drivers' control daemons listen on a UNIX socket named ``control``."""
    (tmp_path / "mps").mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(tmp_path / "mps" / "control"))
        s.listen(1)
        assert mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "mps")})


@pytest.mark.parametrize("what", ["missing directory", "empty directory", "regular file", "dir"])
def test_anything_else_is_not_active(tmp_path: Path, what: str) -> None:
    d = tmp_path / "mps"
    if what != "missing directory":
        d.mkdir()
    if what == "regular file":
        (d / "control").write_text("")
    elif what == "dir":
        (d / "control").mkdir()
    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(d)})


@pytest.mark.skipif(os.geteuid() == 0, reason="root searches any directory")
def test_a_directory_this_user_cannot_search_is_not_active(tmp_path: Path) -> None:
    env = fifo_daemon(tmp_path / "mps")
    (tmp_path / "mps").chmod(0)
    try:
        assert not mps_active(env)
    finally:
        (tmp_path / "mps").chmod(0o755)


def test_nothing_is_said_off_cuda(tmp_path: Path) -> None:
    env = fifo_daemon(tmp_path / "mps")
    for engines in (1, 2):
        assert mps_lines("cpu", engines, env) == []
        assert mps_lines("cpu", engines, {}) == []


def test_active_is_one_info_line_naming_the_daemon(tmp_path: Path) -> None:
    env = fifo_daemon(tmp_path / "mps")
    [(level, line)] = mps_lines("cuda", 1, env)
    assert level == logging.INFO
    assert line == f"CUDA MPS: active (control daemon at {tmp_path / 'mps' / 'control'})"
    [(level, line)] = mps_lines("cuda", 3, env)
    assert level == logging.INFO and "the 3 engines' kernels can run" in line


def test_one_engine_without_mps_is_only_noted(tmp_path: Path) -> None:
    [(level, line)] = mps_lines("cuda", 1, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert level == logging.INFO
    assert (
        line == f"CUDA MPS: not active (no control daemon in {tmp_path}, CUDA_MPS_PIPE_DIRECTORY)"
    )


def test_several_engines_without_mps_warn_once_with_the_fix(tmp_path: Path) -> None:
    [(level, line)] = mps_lines("cuda", 2, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    assert level == logging.WARNING
    assert "\n" not in line
    assert "llm.engines = 2" in line and str(tmp_path) in line
    assert line.endswith(f"({DOCS})") and "fix: start the MPS control daemon" in line
    # Without CUDA_MPS_PIPE_DIRECTORY the line says that the default was looked at.
    if not mps_active({}):
        [(_, line)] = mps_lines("cuda", 2, {})
        assert f"no control daemon in {DEFAULT_PIPE_DIRECTORY}, the default" in line


def test_the_warning_points_at_a_section_that_exists() -> None:
    title = re.fullmatch(r'deploy/README\.md, "(.+)"', DOCS)
    assert title, DOCS
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert f"\n## {title.group(1)}\n" in readme


def test_the_orchestrator_logs_the_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """log_mps (called by Supervisor.run before any worker starts) reads the orchestrator's own
    environment, which every worker inherits."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    log = logging.getLogger("orchestrator.supervisor")
    with caplog.at_level(logging.INFO, logger=log.name):
        log_mps(ServeConfig(device="cuda", llm=LLMConfig(engines=2)), log)
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "llm.engines = 2" in record.getMessage()
    caplog.clear()
    os.mkfifo(tmp_path / "control")
    with caplog.at_level(logging.INFO, logger=log.name):
        log_mps(ServeConfig(device="cuda", llm=LLMConfig(engines=2)), log)
    [record] = caplog.records
    assert record.levelno == logging.INFO and record.getMessage().startswith("CUDA MPS: active")
