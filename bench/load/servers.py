"""Start a server under test as a subprocess, wait until it is ready, stop it cleanly."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from testkit.local_server import NotReady, wait_ready


def add_model_arguments(p: argparse.ArgumentParser, *, device: str | None) -> None:
    """The model, codec and device a server is started on (``bench compare`` and the
    baseline server); ``device``: the default."""
    p.add_argument("--model", required=True, help="Orpheus checkpoint (HF name or directory)")
    p.add_argument("--codec-model", required=True, help="SNAC 24 kHz checkpoint directory")
    p.add_argument("--device", choices=["cpu", "cuda"], default=device)


class ServerFailed(RuntimeError):
    pass


class ServerProcess:
    """``argv`` must serve HTTP on ``url``; its output goes to ``log_path``.

    The server runs in its own process group so that stopping it also stops the
    processes it started (vLLM's engine core, workers).
    """

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.url = url.rstrip("/")
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.ready_after_s: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs (started and not yet stopped)."""
        return self._proc.pid if self._proc is not None else None

    def wait_ready(self, timeout_s: float) -> None:
        assert self._proc is not None, "start() first"
        try:
            self.ready_after_s = wait_ready(self.url, self._proc.poll, timeout_s)
        except NotReady as e:
            raise ServerFailed(
                f"{self.name}: {e}; see {self.log_path}:\n{self.log_tail()}"
            ) from None

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (a clean drain), then SIGKILL of the whole group past the timeout."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                print(f"{self.name} did not stop in {timeout_s:.0f}s: killing it", file=sys.stderr)
        # Whatever the server left behind in its group (engine core, workers) goes too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        code = proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def baseline_argv(
    model: str, codec_model: str, device: str, port: int, extra: list[str] | None = None
) -> list[str]:
    return [
        sys.executable, "-m", "bench.compare.baseline", "--model", model, "--codec-model", codec_model,
        "--device", device, "--host", "127.0.0.1", "--port", str(port), *(extra or []),
    ]  # fmt: skip


ORPHEUS_SERVE = str(Path(sys.executable).parent / "orpheus-serve")
"""The command of this environment (the one that runs the benchmark)."""


def recorded_argv(argv: list[str]) -> list[str]:
    """``argv`` as a result file records it: a command under the current directory is named
    relative to it, so that committed results name no path of the machine that ran them."""
    exe = Path(argv[0])
    if exe.is_absolute() and exe.is_relative_to(Path.cwd()):
        return [str(exe.relative_to(Path.cwd())), *argv[1:]]
    return list(argv)


def orpheus_serve_argv(
    model: str, codec_model: str | None, device: str, port: int, extra: list[str] | None = None
) -> list[str]:
    """``orpheus-serve serve`` on loopback; ``codec_model`` None: the server finds
    ``model/snac`` itself."""
    codec = ["--codec-model", codec_model] if codec_model is not None else []
    return [
        ORPHEUS_SERVE, "serve", "--model", model, *codec, "--device", device,
        "--host", "127.0.0.1", "--port", str(port), *(extra or []),
    ]  # fmt: skip
