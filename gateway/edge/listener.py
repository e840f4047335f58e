"""The gateway's listening socket and what aiohttp leaves to the server: clients that hold
connections without finishing a request, and more connections than the process has
descriptors for.

- **Connection limit** (``gateway.max_connections``, at most the open-file limit less
  ``FD_RESERVE``): a connection past it is answered ``503`` (JSON, ``Retry-After``) and
  closed at once, before the process runs out of descriptors; a WARNING says so, at most
  once per ``REFUSAL_LOG_INTERVAL_S``.
- **Header timeout** (``gateway.header_timeout_s``): a connection that has not sent a whole
  request header this long after connecting is answered ``408`` and closed (slowloris).
  Later requests on a kept-alive connection are bounded by aiohttp's keep-alive timeout
  (``gateway.keepalive_timeout_s``), which runs from the end of the last response.
- **Body timeout** (``gateway.body_timeout_s``, the middleware ``body_deadline``): a request
  whose body has not fully arrived this long after its handler started is answered ``408``
  and its connection closed.

Everything here wraps aiohttp's own request handler without changing it: ``listen`` serves
``runner.server`` through ``ConnectionGuard``.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from typing import Any, cast

from aiohttp import web

from common.config.gateway import GatewayConfig
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0
"""How long handlers still running when the gateway stops may take (aiohttp's cleanup)."""
FD_RESERVE = 256
"""Descriptors kept for everything that is not a client connection (ZeroMQ, shared memory,
logs, the refusals themselves)."""
REFUSAL_LOG_INTERVAL_S = 10.0
_HEADER_END = (b"\r\n\r\n", b"\n\n")


def _canned(status: int, reason: str, code: str, message: str, retry: int | None) -> bytes:
    body = APIError(status, code, message).to_json()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
        "Connection: close",
    ]
    if retry is not None:
        head.append(f"Retry-After: {retry}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def connection_limit(configured: int) -> int:
    """``configured``, lowered to what the open-file limit leaves for client connections."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return configured
    return max(1, min(configured, soft - FD_RESERVE))


class ConnectionGuard:
    """Counts this process's client connections, refuses those past the limit, and closes
    those that do not send a request header in time."""

    def __init__(
        self,
        factory: web.Server,
        *,
        max_connections: int,
        header_timeout_s: float,
        retry_after_s: int = 1,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._factory = factory
        self._metrics = metrics
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s
        self.active = 0
        self.refused = 0
        """Connections refused at the limit, since the start."""
        self.header_timeouts = 0
        self._unlogged = 0
        self._last_log = float("-inf")
        self._refusal = _canned(
            503,
            "Service Unavailable",
            "too_many_connections",
            "this gateway process is at its connection limit; retry shortly",
            retry_after_s,
        )
        self._timeout = _canned(
            408,
            "Request Timeout",
            "request_timeout",
            f"no complete request header within {header_timeout_s:g} s",
            None,
        )

    def __call__(self) -> asyncio.Protocol:
        return _GuardedProtocol(self, self._factory())

    def _note_refusal(self, loop: asyncio.AbstractEventLoop) -> None:
        self.refused += 1
        if self._metrics is not None:
            self._metrics.connections_refused.inc()
        self._unlogged += 1
        now = loop.time()
        if now - self._last_log >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "connection limit (%d) reached: refused %d new connection(s) with 503 "
                "(gateway.max_connections; open-file limit less %d)",
                self.max_connections,
                self._unlogged,
                FD_RESERVE,
            )
            self._unlogged = 0
            self._last_log = now


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler for one connection, behind the guard's two checks."""

    __slots__ = ("_admitted", "_guard", "_inner", "_tail", "_timer", "_transport")

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self._guard = guard
        self._inner = inner
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._transport = transport
        g = self._guard
        loop = asyncio.get_running_loop()
        if g.active >= g.max_connections:
            g._note_refusal(loop)
            transport.write(g._refusal)
            transport.close()
            return
        g.active += 1
        self._admitted = True
        if g.header_timeout_s > 0:
            self._timer = loop.call_later(g.header_timeout_s, self._header_timeout)
        self._inner.connection_made(transport)

    def _header_timeout(self) -> None:
        self._timer = None
        t = self._transport
        if t is not None and not t.is_closing():
            self._guard.header_timeouts += 1
            if self._guard._metrics is not None:
                self._guard._metrics.header_timeouts.inc()
            t.write(self._guard._timeout)
            t.close()

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._timer is not None:
            seen = self._tail + data
            if any(end in seen for end in _HEADER_END):
                self._timer.cancel()
                self._timer = None
                self._tail = b""
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if not self._admitted:
            return None
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None
        if self._admitted:
            self._admitted = False
            self._guard.active -= 1
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._admitted:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._admitted:
            self._inner.resume_writing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Listener:
    """The serving socket of one gateway process (close it before ``runner.cleanup()``)."""

    def __init__(self, server: asyncio.AbstractServer, guard: ConnectionGuard) -> None:
        self.server = server
        self.guard = guard

    def close(self) -> None:
        """Stop accepting. Not ``wait_closed``: that waits for every open connection (uvloop,
        Python 3.12+), which ``runner.cleanup()`` closes afterwards."""
        self.server.close()


def app_runner(
    app: web.Application, g: GatewayConfig, access_log: Any = None, **kwargs: Any
) -> web.AppRunner:
    """aiohttp's runner with the gateway's keep-alive timeout; a client that disconnects
    cancels its handler. ``kwargs`` go to ``web.AppRunner`` (and on to aiohttp's request
    handler: ``logger``, ``max_line_size``, ...)."""
    return web.AppRunner(
        app,
        handle_signals=False,
        handler_cancellation=True,
        access_log=access_log,
        keepalive_timeout=g.keepalive_timeout_s,
        # What handlers still run at cleanup get this long: the drain (drain_timeout_s) has
        # already waited for the streams and failed those left, so aiohttp's 60 s default
        # would only keep a stopping gateway alive.
        shutdown_timeout=SHUTDOWN_GRACE_S,
        **kwargs,
    )


async def listen(
    runner: web.AppRunner,
    sock: socket.socket,
    g: GatewayConfig,
    metrics: GatewayMetrics | None = None,
) -> Listener:
    """Serve ``runner`` (set up) on the listening ``sock`` behind a ``ConnectionGuard``
    (refusals and header timeouts counted in ``metrics``)."""
    server = runner.server
    assert server is not None, "runner.setup() first"
    guard = ConnectionGuard(
        server,
        max_connections=connection_limit(g.max_connections),
        header_timeout_s=g.header_timeout_s,
        retry_after_s=g.retry_after_s,
        metrics=metrics,
    )
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(guard, sock=sock)
    return Listener(srv, guard)


def body_deadline(timeout_s: float, metrics: GatewayMetrics | None = None) -> Any:
    """Middleware: the body of a request must have arrived ``timeout_s`` after its handler
    started, else its read fails with 408 ``request_timeout`` and the connection closes
    (counted in ``metrics``)."""

    @web.middleware
    async def deadline(request: web.Request, handler: Any) -> web.StreamResponse:
        if timeout_s <= 0 or not request.body_exists or request.content.is_eof():
            return await handler(request)
        content = request.content
        expired = False

        def expire() -> None:
            nonlocal expired
            if not content.is_eof():
                expired = True
                if metrics is not None:
                    metrics.body_timeouts.inc()
                content.set_exception(
                    APIError(
                        408,
                        "request_timeout",
                        f"the request body did not arrive within {timeout_s:g} s",
                    )
                )

        timer = asyncio.get_running_loop().call_later(timeout_s, expire)
        try:
            resp = await handler(request)
        finally:
            timer.cancel()
        if expired:
            # Send the 408 now and close: what is left of the body is not read.
            resp.force_close()
            await resp.prepare(request)
            await resp.write_eof()
            request.protocol.force_close()
        return resp

    return deadline
