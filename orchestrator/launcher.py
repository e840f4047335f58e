"""How the supervisor starts a worker process: its seam to the operating system.

The supervisor builds a worker's command line and environment and hands them to a
``Launcher``; what comes back is a ``Process``, which ``subprocess.Popen`` is. Tests give
the supervisor a launcher of their own (processes that exit, or never do, when the test
says) and drive its supervision pass by pass.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol


class Process(Protocol):
    """The part of ``subprocess.Popen`` the supervisor uses."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        ...

    def kill(self) -> None: ...

    def send_signal(self, sig: int) -> None: ...


Launcher = Callable[[Sequence[str], Mapping[str, str]], Process]
"""Starts ``args`` with the environment ``env`` (the whole of it, not added to ours)."""


def launch_in_own_session(args: Sequence[str], env: Mapping[str, str]) -> Process:
    """Start a worker in its own session: a terminal's Ctrl-C reaches only the orchestrator,
    which stops the children in order (gateways drain first), and the worker's process group
    (vLLM's processes included) can be killed as one (``orchestrator.proctree``)."""
    return subprocess.Popen(list(args), env=dict(env), start_new_session=True)
