"""Logging setup shared by every process: text or JSON lines on stderr.

``log_level`` (INFO by default) is the level of this project's own lines: one per phase of a
start and a stop. The libraries below it (vLLM, torch, triton, transformers, httpx...) are
held at WARNING, so their warnings and errors still reach the operator but their chatter
does not; ``log_level=DEBUG`` gives them back their own INFO. Output the libraries write
themselves, outside Python logging, is set by their own switches (:func:`library_env`):
vLLM's ``VLLM_LOGGING_LEVEL``, tqdm's ``TQDM_DISABLE``, the hub's
``HF_HUB_DISABLE_PROGRESS_BARS``; a variable the operator set is left as it is.
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Mapping
from typing import Any, TextIO

LIBRARY_LOGGERS = (
    "vllm",
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "huggingface_hub",
    "httpx",
    "httpcore",
    "urllib3",
    "filelock",
    "asyncio",
    "numba",
    "PIL",
)
"""Python loggers of the libraries the processes use: at WARNING unless log_level=DEBUG."""

LIBRARY_MODULES = r"(vllm|torch|triton|transformers|huggingface_hub|snac)(\.|$)"
"""Modules whose deprecation warnings (a library calling another's deprecated API: nothing
an operator can act on) are shown only at log_level=DEBUG."""

NANOBIND_MODULES = ("triton._C.libtriton",)
"""Extensions built with nanobind, which prints a report of the objects still alive at
interpreter teardown (triton's, imported by vLLM: hundreds of lines, nothing to act on)."""


def _subprocess(record: logging.LogRecord) -> str | None:
    """The multiprocessing name of a process the worker started (vLLM's ``EngineCore``, its
    workers), or None in the worker itself."""
    name = record.processName
    return None if name in (None, "MainProcess") else name


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
        if (sub := _subprocess(record)) is not None:
            out["subprocess"] = sub
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            out.update(extra)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """``<time> <LEVEL> [<role>:<pid>] <logger>: <message>``; in a process vLLM started (its
    engine core, its workers) the tag names it: ``[llm:<pid>/EngineCore]``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s [%(tag)s] %(name)s: %(message)s")
        self._role = os.environ.get("ORPHEUS_SERVE_ROLE", "orchestrator")

    def format(self, record: logging.LogRecord) -> str:
        sub = _subprocess(record)
        record.tag = f"{self._role}:{record.process}" + (f"/{sub}" if sub else "")
        return super().format(record)


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


def verbose(level: str) -> bool:
    """Whether ``log_level`` asks for the libraries' own chatter too."""
    return level.upper() == "DEBUG"


def library_level(level: str) -> int:
    """The level of the libraries' loggers for ``log_level``: INFO (their own default) at
    DEBUG, otherwise ``log_level`` but never below WARNING."""
    ours = logging.getLevelName(level.upper())
    if not isinstance(ours, int):
        ours = logging.INFO
    return logging.INFO if ours <= logging.DEBUG else max(logging.WARNING, ours)


def library_env(level: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Environment for the worker processes (inherited by what they start: vLLM's engine core
    and workers) that sets the libraries' own output switches for ``log_level``. Variables
    already in ``environ`` (the operator's) are not returned: they win."""
    want = {"VLLM_LOGGING_LEVEL": logging.getLevelName(library_level(level))}
    if "VLLM_LOGGING_CONFIG_PATH" not in environ:
        # vLLM's records go to the process's own handler (this module's format, JSON lines
        # included), not to a handler vLLM installs with its format; this also stops vLLM
        # 0.25 from prefixing every stdout/stderr line with "(EngineCore pid=N)". An
        # operator's vLLM logging config file needs vLLM's configuration on: it is kept.
        want["VLLM_CONFIGURE_LOGGING"] = "0"
    if not verbose(level):
        # Progress bars (the hub's downloads; vLLM's weight loading: llm_worker.engine.args
        # passes tqdm's switch on as vLLM's use_tqdm_on_load).
        want["TQDM_DISABLE"] = "1"
        want["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    return {k: v for k, v in want.items() if k not in environ}


def quiet_teardown(level: str) -> None:
    """At exit, after every atexit handler registered later than this call (call it early),
    send stderr to /dev/null if a nanobind extension is loaded: its teardown report (see
    :data:`NANOBIND_MODULES`) has no switch a user can reach (``nb::set_leak_warnings`` is
    C++ only, not exported by triton). triton silences it the same way in its own compile
    workers. Kept at ``log_level=DEBUG``."""
    if not verbose(level):
        atexit.register(_silence_nanobind_teardown)


def _silence_nanobind_teardown() -> None:
    if not any(name in sys.modules for name in NANOBIND_MODULES):
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 2)
        os.close(fd)
    except OSError:
        pass


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    handler = QuietStreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLineFormatter())
    else:
        handler.setFormatter(TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(library_level(level))
    # vLLM's own switch (``library_env`` sets it for the workers; an operator's value wins)
    # is the level of its logger here, since vLLM does not install a handler of its own.
    vllm_level = logging.getLevelName(os.environ.get("VLLM_LOGGING_LEVEL", "").upper())
    if isinstance(vllm_level, int):
        logging.getLogger("vllm").setLevel(vllm_level)
    # Python warnings become log lines (with the process's role), filtered like the rest.
    logging.captureWarnings(True)
    if not verbose(level):
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=LIBRARY_MODULES)
