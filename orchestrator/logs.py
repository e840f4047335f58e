"""Logging setup shared by every process: text or JSON lines on stderr."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


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
