"""common/mps.py: whether CUDA clients of this environment would find an MPS control daemon
(its ``control`` FIFO in the pipe directory the driver looks in)."""

from __future__ import annotations

import os
from pathlib import Path

from common.mps import DEFAULT_PIPE_DIRECTORY, mps_active, mps_pipe_directory


def test_the_pipe_directory_is_the_drivers() -> None:
    assert mps_pipe_directory({}) == Path(DEFAULT_PIPE_DIRECTORY) == Path("/tmp/nvidia-mps")
    assert mps_pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": ""}) == Path(DEFAULT_PIPE_DIRECTORY)
    assert mps_pipe_directory({"CUDA_MPS_PIPE_DIRECTORY": "/x/y"}) == Path("/x/y")


def test_active_only_with_a_control_fifo(tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    assert not mps_active(env)  # no daemon
    (tmp_path / "control").write_text("")
    assert not mps_active(env)  # a plain file is not the daemon's pipe
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")
    assert mps_active(env)
    assert not mps_active({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "missing")})
