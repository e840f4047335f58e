"""Malformed HTTP requests in the operator's log: one WARNING line per client per interval.

aiohttp answers a request it cannot parse (Content-Length with Transfer-Encoding, a negative
Content-Length, a header line over 8190 bytes, more than 128 headers, ...) with 400 and
closes the connection; then it logs the parser's exception through the protocol's
``logger`` (``aiohttp.server`` by default) with ``logger.exception``: an ERROR with a
traceback that quotes the offending bytes, once per request. Anyone who can reach the port
could fill the log and fire the operator's error alerts.

``server_options`` hands aiohttp a ``MalformedRequestLog`` as that logger (the ``logger``
argument of its request handler, passed through ``web.AppRunner``): records about a parse
error (``HttpProcessingError``) become one line per client address per
``gateway.http_error_log_interval_s``, at WARNING (or aiohttp's own lower level), with the
exception's class and the fixed part of its reason only; the rest are counted and the count
is given on the client's next line. Everything else passes through to ``aiohttp.server``
unchanged (a handler's unexpected exception stays an ERROR with its traceback).
"""

from __future__ import annotations

import logging
import re
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.log import server_logger

from common.config.gateway import GatewayConfig

MAX_CLIENTS = 4096
"""Client addresses remembered (least recently logged forgotten first)."""
MAX_REASON_CHARS = 80
_QUOTED = re.compile(r"[:\\\n\r]|\s(?:b?['\"])")
"""Where a reason is cut: what follows (a colon, a quote) quotes the request's bytes."""


def safe_reason(exc: HttpProcessingError) -> str:
    """The exception's class and the fixed words of its message, without request bytes."""
    message = exc.message if isinstance(exc.message, str) else ""
    head = _QUOTED.split(message, maxsplit=1)[0]
    words = "".join(c for c in head if c.isprintable()).strip()[:MAX_REASON_CHARS]
    return f"{type(exc).__name__}: {words}" if words else type(exc).__name__


def _exception_of(exc_info: object) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1] if isinstance(exc_info[1], BaseException) else None
    return None  # exc_info=True: aiohttp always passes the exception itself


class MalformedRequestLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger, with parse errors rate-limited per client and sanitized."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float,
        *,
        max_clients: int = MAX_CLIENTS,
        clock: Any = time.monotonic,
    ) -> None:
        super().__init__(logger, {})
        self.interval_s = interval_s
        self._max_clients = max_clients
        self._clock = clock
        self._clients: OrderedDict[str, list[float]] = OrderedDict()
        """Client address -> [time of its last logged line, requests not logged since]."""

    def log(  # type: ignore[override]
        self,
        level: int,
        msg: object,
        *args: object,
        exc_info: object = None,
        stack_info: bool = False,
        stacklevel: int = 1,
        extra: Mapping[str, object] | None = None,
    ) -> None:
        exc = _exception_of(exc_info)
        if not isinstance(exc, HttpProcessingError):
            if self.logger.isEnabledFor(level):
                self.logger.log(
                    level, msg, *args, exc_info=exc_info, stack_info=stack_info,  # type: ignore[arg-type]
                    stacklevel=stacklevel + 1, extra=extra,
                )  # fmt: skip
            return
        # aiohttp: "Error handling request from %s", request.remote
        client = str(args[0]) if len(args) == 1 else "unknown"
        level = min(level, logging.WARNING)
        if not self.logger.isEnabledFor(level):
            return
        now = self._clock()
        seen = self._clients.get(client)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return
        skipped = int(seen[1]) if seen is not None else 0
        self._clients[client] = [now, 0]
        self._clients.move_to_end(client)
        while len(self._clients) > self._max_clients:
            self._clients.popitem(last=False)
        more = f" ({skipped} more from this client not logged)" if skipped else ""
        self.logger.log(
            level,
            "malformed HTTP request from %s answered %d (%s)%s; logged at most once per %g s "
            "per client",
            client, exc.code, safe_reason(exc), more, self.interval_s,
        )  # fmt: skip


def server_options(config: GatewayConfig) -> dict[str, Any]:
    """Keyword arguments for ``web.AppRunner`` (aiohttp's request handler)."""
    return {"logger": MalformedRequestLog(server_logger, config.http_error_log_interval_s)}
