"""The console of ``make demo``: a few lines of progress for a person at a terminal, while
everything the commands it runs print (the server's orchestrator and workers, vLLM's engine
core and workers, the tiny-model writer) goes to one log file, whose path it prints.

On failure the console shows the last lines of that log and, last, the one-line cause: the
server's own ``orpheus-serve: <cause>; fix: <fix>`` where it wrote one.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, TextIO

from testkit.local_server import is_ready

TAIL_LINES = 15
"""Lines of the log shown on failure."""
CAUSE_PREFIX = "orpheus-serve: "
"""How ``orpheus-serve`` words the one line that says why it stopped (cli.tell)."""

# The orchestrator's lines that are worth a console line while the server starts (text log
# format): a worker that became ready, and one that died and is being restarted.
_READY = re.compile(r"orchestrator\.supervisor: (codec|llm)(?:-\d+)? ready \(pid \d+, ([\d.]+)s\)")
_RESTART = re.compile(r"orchestrator\.supervisor: (.+ exited with .+; restarting in .+)$")
_WORKER_NAMES = {"codec": "codec worker (SNAC)", "llm": "llm worker (vLLM)"}


class NotReady(RuntimeError):
    """The server exited, or was not ready in time; the message says which."""


class Console:
    """Progress lines on ``out``; the commands' output appended to ``log_path``."""

    def __init__(self, log_path: Path, out: TextIO | None = None) -> None:
        self.log_path = log_path.resolve()
        self.out = out if out is not None else sys.stdout
        self._offset = 0
        self._partial = b""

    # -- what the person reads --------------------------------------------------------------
    def line(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def step(self, text: str) -> None:
        self.line(f"  {text}")

    def begin(self, title: str) -> None:
        """Start a new log (an earlier run's is replaced)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.write_bytes(b"")
        self._offset = 0
        self._partial = b""
        self.line(title)

    def fail(self, cause: str, code: int = 1) -> int:
        """The end of a failed run: the log's last lines, then the one-line cause (the
        server's own where it wrote one). Returns ``code``."""
        lines = self.log_lines()
        server_cause = last_cause(lines)
        cause_line = server_cause or f"{CAUSE_PREFIX}{cause}"
        tail = [ln for ln in lines if ln != server_cause][-TAIL_LINES:]
        if tail:
            self.line(f"FAILED: {cause}. The last lines of {self.log_path}:")
            for ln in tail:
                self.line(f"  | {ln}")
        else:
            self.line(f"FAILED: {cause} (the log {self.log_path} is empty)")
        self.line(cause_line)
        return code

    # -- the commands ------------------------------------------------------------------------
    def _log(self) -> IO[bytes]:
        return open(self.log_path, "ab")

    def note(self, text: str) -> None:
        """A line in the log only (what the console says, for a reader of the log alone)."""
        with self._log() as log:
            log.write(f"==> {text}\n".encode())

    def run(self, cmd: Sequence[str | Path]) -> int:
        """Run a command to completion, its output into the log; its exit code."""
        self.note("$ " + " ".join(map(str, cmd)))
        with self._log() as log:
            return subprocess.run(cmd, stdout=log, stderr=log, check=False).returncode

    def start(self, cmd: Sequence[str | Path]) -> subprocess.Popen[bytes]:
        """Start a command in the background, its output into the log."""
        self.note("$ " + " ".join(map(str, cmd)))
        with self._log() as log:
            return subprocess.Popen(cmd, stdout=log, stderr=log)

    def wait_ready(
        self, url: str, server: subprocess.Popen[bytes], timeout_s: float, interval_s: float = 0.5
    ) -> float:
        """Poll the server's ``GET /ready`` until it answers 200 (the seconds waited), saying
        on the console when each worker is ready (or restarted), as the server's log says.
        Raises :class:`NotReady` at once if the server exits, or after ``timeout_s``."""
        t0 = time.monotonic()
        while True:
            self._follow()
            if (code := server.poll()) is not None:
                self._follow()
                raise NotReady(f"the server exited with {code} before it was ready")
            if is_ready(url):
                self._follow()
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise NotReady(f"the server was not ready after {timeout_s:.0f} s")
            time.sleep(interval_s)

    def _follow(self) -> None:
        """Console lines for the orchestrator's phase lines logged since the last call."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return
        self._offset += len(data)
        *complete, self._partial = (self._partial + data).split(b"\n")
        for raw in complete:
            text = raw.decode(errors="replace")
            if m := _READY.search(text):
                self.step(f"{_WORKER_NAMES[m.group(1)]} ready after {float(m.group(2)):.1f} s")
            elif m := _RESTART.search(text):
                self.step(f"{m.group(1)} (the log says why)")

    def log_lines(self) -> list[str]:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [ln for ln in text.splitlines() if ln.strip()]


def last_cause(lines: Sequence[str]) -> str | None:
    """The last ``orpheus-serve: <cause>; fix: <fix>`` line of a log, if any."""
    for ln in reversed(lines):
        if ln.startswith(CAUSE_PREFIX):
            return ln
    return None


def stop(server: subprocess.Popen[bytes], sig: int, timeout_s: float = 60.0) -> int:
    """Stop a server started with :meth:`Console.start`; its exit code."""
    if server.poll() is None:
        server.send_signal(sig)
    try:
        return server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        return server.wait()
