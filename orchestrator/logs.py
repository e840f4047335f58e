"""Logging setup shared by every process: text or JSON lines on stderr."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import time
from typing import Any, TextIO


class JsonLineFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "proc": os.environ.get("ORPHEUS_SERVE_ROLE", "orchestrator"),
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class QuietStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A stderr handler that drops a line it cannot write (a full disk under a redirected
    log: ENOSPC, EFBIG) instead of printing "--- Logging error ---" and a traceback to that
    same full stderr for each one. Serving goes on; the lines are lost until there is room."""

    dropped = 0

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            self.dropped += 1
            return
        super().handleError(record)  # a bad format string is still reported


class TolerantStream(io.TextIOBase):
    """A text stream that drops what it cannot write instead of raising.

    stdout/stderr redirected to a file on a full disk fail every write with ENOSPC (EFBIG past
    a file-size limit, EPIPE when a log pipe's reader is gone). Libraries do not expect that:
    a progress bar (tqdm, while vLLM loads weights) or a print() raises and the worker dies
    at start-up, again at each restart. Losing log lines is the lesser harm."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self.dropped = 0

    def write(self, s: str) -> int:
        try:
            return self._inner.write(s)
        except OSError:
            self.dropped += 1
            return len(s)

    def flush(self) -> None:
        try:
            self._inner.flush()
        except OSError:
            self.dropped += 1

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self._inner.isatty()

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._inner.encoding

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def protect_stdio() -> None:
    """Make sys.stdout and sys.stderr tolerant (:class:`TolerantStream`) in this process and
    in the processes it forks (vLLM's EngineCore and Workers inherit them)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, TolerantStream):
            setattr(sys, name, TolerantStream(stream))


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = QuietStreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLineFormatter())
    else:
        role = os.environ.get("ORPHEUS_SERVE_ROLE", "orchestrator")
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s %(levelname)s [{role}:%(process)d] %(name)s: %(message)s"
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
