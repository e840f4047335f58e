"""Whether this process's CUDA contexts would go through NVIDIA's Multi-Process Service.

Several vLLM engines on one GPU overlap their kernels only under MPS; without it the
contexts time-slice. The server logs it (and warns for ``llm.engines`` > 1 without it), and
``bench engine`` records it beside its numbers.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

PIPE_DIRECTORY_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
"""Where the CUDA driver looks for the daemon when ``CUDA_MPS_PIPE_DIRECTORY`` is unset."""


def mps_pipe_directory(environ: Mapping[str, str] = os.environ) -> Path:
    """The directory a CUDA client of this environment looks in for the MPS control pipe."""
    return Path(environ.get(PIPE_DIRECTORY_ENV) or DEFAULT_PIPE_DIRECTORY)


def mps_active(environ: Mapping[str, str] = os.environ) -> bool:
    """True when an MPS control daemon is listening where this process's CUDA clients look.

    It decides the way the CUDA driver finds the daemon: the pipe directory is
    ``CUDA_MPS_PIPE_DIRECTORY`` when set (and not empty), else ``/tmp/nvidia-mps``, and the
    daemon (``nvidia-cuda-mps-control -d``) is up when that directory holds its ``control``
    named pipe (a FIFO). Nothing is started or connected to, and no CUDA call is made, so it
    is safe before CUDA is initialised and costs a ``stat``. A ``control`` pipe left by a
    daemon that was killed (not stopped with ``quit``) still reads as active: the first CUDA
    context then fails to start, which the server reports on its own.
    """
    try:
        mode = (mps_pipe_directory(environ) / "control").stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode)
