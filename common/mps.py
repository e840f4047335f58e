"""Whether this process would run under NVIDIA's Multi-Process Service (CUDA MPS).

Several processes' kernels run at the same time on one GPU only under MPS: without it each
process has a CUDA context of its own and the GPU time-slices between the contexts. With
``llm.engines > 1`` on CUDA the engines should therefore be MPS clients (deploy/README.md,
"CUDA MPS").

A CUDA process becomes an MPS client at its first CUDA call if an MPS control daemon
answers in its pipe directory: ``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``. The
daemon keeps a ``control`` entry there: a UNIX socket in current drivers (its log says
"Starting control daemon using socket <dir>/control"), a named pipe in older ones.
:func:`mps_active` looks for that entry from the same environment the workers inherit, so it
answers the question the CUDA driver will ask, without touching the GPU or the driver.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

PIPE_DIRECTORY_ENV = "CUDA_MPS_PIPE_DIRECTORY"
DEFAULT_PIPE_DIRECTORY = "/tmp/nvidia-mps"
CONTROL = "control"


def pipe_directory(environ: Mapping[str, str] = os.environ) -> str:
    """Where this process's CUDA driver looks for the MPS control daemon."""
    return environ.get(PIPE_DIRECTORY_ENV) or DEFAULT_PIPE_DIRECTORY


def control_path(environ: Mapping[str, str] = os.environ) -> str:
    return os.path.join(pipe_directory(environ), CONTROL)


def mps_active(environ: Mapping[str, str] = os.environ) -> bool:
    """True when an MPS control daemon's ``control`` pipe or socket is in this process's
    pipe directory, so that the CUDA processes it starts would become MPS clients.

    What it can tell: a daemon set up the directory that this process (and the workers that
    inherit its environment) will look in; ``CUDA_MPS_PIPE_DIRECTORY`` pointing somewhere
    else than the daemon's, or a service sandbox that hides it (systemd's ``PrivateTmp=``
    hides the default ``/tmp/nvidia-mps``), reads as inactive, as it would for CUDA.

    What it cannot tell:

    - Whether the daemon still runs: one killed with SIGKILL may leave its ``control`` entry
      behind (stopping deploy/systemd/nvidia-mps.service removes the whole directory). The
      probe neither connects nor writes, so it never disturbs a live daemon.
    - Whether the clients will be served: the MPS server takes clients of one user id at a
      time, and a daemon started for other GPUs (its ``CUDA_VISIBLE_DEVICES``) does not
      serve this one; the engines' start-up and ``nvidia-smi`` say so (deploy/README.md).
    - MPS on the host seen from a container whose pipe directory is not mounted reads as
      inactive, and rightly: the container's CUDA processes cannot reach that daemon either.
    - The GPU's compute mode (``EXCLUSIVE_PROCESS`` is advised, not required).
    """
    try:
        mode = os.stat(control_path(environ)).st_mode
    except OSError:  # absent, or a directory this user may not search
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)
