"""Profiling hooks of the workers: armed by the environment, triggered by a file.

``ORPHEUS_PROFILE_DIR=DIR`` arms them (unset: nothing here runs and no profiler exists);
``ORPHEUS_PROFILE_SECONDS=S`` is the length of one capture (default 3). Writing
``DIR/trigger`` (its content is a label, e.g. ``bf16-c320``) asks every armed worker for one
capture: each notices the file's new mtime on its periodic check (never on a hot path),
captures for ``S`` seconds, then writes ``DIR/<role>-<pid>.done``, a JSON ``ProfileDone``.
This lets a benchmark profile a server at its capacity limit without restarting it
(scripts/gpu/run_capacity.sh; docs/gpu.md "Profiling hooks").
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec

ENV_DIR = "ORPHEUS_PROFILE_DIR"
ENV_SECONDS = "ORPHEUS_PROFILE_SECONDS"
DEFAULT_SECONDS = 3.0
TRIGGER_FILE = "trigger"


class ProfileDone(msgspec.Struct, frozen=True):
    """What one worker wrote for one trigger (``DIR/<role>-<pid>.done``)."""

    role: str
    pid: int
    label: str
    started: float
    """Wall-clock seconds (time.time) when the capture began."""
    ended: float
    files: list[str]
    error: str = ""
    """Why the capture failed ("" when it worked)."""


class ProfileTrigger:
    """One worker's view of ``DIR/trigger``: ``poll()`` returns a new trigger's label once."""

    def __init__(self, directory: Path, seconds: float, role: str) -> None:
        self.directory = directory
        self.seconds = seconds
        self.role = role
        self._trigger = directory / TRIGGER_FILE
        # A trigger written before this worker started is not a request to it.
        self._seen = self._mtime()

    @classmethod
    def from_env(cls, role: str, env: Mapping[str, str] | None = None) -> ProfileTrigger | None:
        """The hooks if ``ORPHEUS_PROFILE_DIR`` is set, else None. Bad values raise ValueError."""
        env = os.environ if env is None else env
        raw_dir = env.get(ENV_DIR, "")
        if not raw_dir:
            return None
        raw_seconds = env.get(ENV_SECONDS, "") or str(DEFAULT_SECONDS)
        try:
            seconds = float(raw_seconds)
        except ValueError:
            raise ValueError(f"{ENV_SECONDS}={raw_seconds!r} is not a number") from None
        if not seconds > 0:
            raise ValueError(f"{ENV_SECONDS} must be > 0, not {raw_seconds!r}")
        directory = Path(raw_dir).absolute()  # vLLM wants an absolute trace directory
        directory.mkdir(parents=True, exist_ok=True)
        return cls(directory, seconds, role)

    def _mtime(self) -> float:
        try:
            return self._trigger.stat().st_mtime
        except OSError:
            return 0.0

    def poll(self) -> str | None:
        """The label of a trigger newer than the last one seen, or None (one stat call)."""
        mtime = self._mtime()
        if mtime <= self._seen:
            return None
        self._seen = mtime
        try:
            label = self._trigger.read_text().strip()
        except OSError:
            label = ""
        return label or f"trigger-{int(mtime)}"

    def trace_path(self) -> Path:
        """Where a worker that writes its own trace puts it (gzipped Chrome trace JSON)."""
        return self.directory / f"{self.role}-{os.getpid()}.pt.trace.json.gz"

    def files_since(self, started: float, under: Path | None = None) -> list[str]:
        """Files under ``under`` (default: the directory) modified since ``started``."""
        root = under or self.directory
        found = []
        for path in root.rglob("*"):
            try:
                if path.is_file() and path.stat().st_mtime >= started and path.suffix != ".done":
                    found.append(str(path))
            except OSError:
                continue
        return sorted(found)

    def write_done(self, label: str, started: float, files: list[str], error: str = "") -> Path:
        """Report a capture that ended now: write the ``.done`` file atomically (the benchmark
        polls for it)."""
        done = ProfileDone(self.role, os.getpid(), label, started, time.time(), files, error)
        path = self.directory / f"{self.role}-{os.getpid()}.done"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(done))
        os.replace(tmp, path)
        return path
