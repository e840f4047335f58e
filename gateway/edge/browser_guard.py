"""What a web page in someone's browser may do with the gateway (``gateway.allowed_origins``,
``gateway.allowed_hosts``).

A browser lets any page send "simple" requests (a ``text/plain`` speech body, a multipart
voice upload) and open WebSockets to any server, without asking it first; with DNS
rebinding a foreign page even becomes same-origin with the server under its own host name.
Two checks, on every request before the API key:

- **Origin**: a request that carries an ``Origin`` header (browsers send one on every
  POST, CORS request and WebSocket upgrade) is refused with 403 ``origin_not_allowed``
  unless it is the server's own (the origin's host and port are the ``Host`` the request was
  sent to: the playground) or listed in ``gateway.allowed_origins`` (``"*"``: any). Clients
  that send no ``Origin`` (SDKs, voice agents, curl) are not affected. An allowed foreign
  origin gets CORS headers, and its preflight (``OPTIONS``) is answered.
- **Host** (only while no API key is configured, except ``/health`` and ``/ready``): the
  ``Host`` must be the server's own: an IP address, ``localhost`` (or ``*.localhost``),
  ``gateway.host`` when it is a name, or a name in ``gateway.allowed_hosts`` (``"*"``: any).
  Anything else is 403 ``host_not_allowed``: a DNS-rebinding page reaches the server under
  a name of its own, never as an IP address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

from common.config.gateway import GatewayConfig
from gateway.errors import APIError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]

UNCHECKED_HOST_PATHS = frozenset({"/health", "/ready"})
"""Probes (load balancers send a Host of their own); they reveal nothing."""
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
CORS_METHODS = "GET, POST, DELETE, OPTIONS"
CORS_HEADERS = "Authorization, Content-Type, xi-api-key"


def split_host(value: str, default_port: int | None = None) -> tuple[str, int | None]:
    """``host[:port]`` (``[v6]:port`` too) as (lower-case host, port)."""
    value = value.strip().lower()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, _, port = value.partition(":")
    else:
        host, port = value, ""
    try:
        return host.rstrip("."), int(port) if port else default_port
    except ValueError:
        return host, -1


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class BrowserGuard:
    def __init__(self, g: GatewayConfig, keys_required: bool) -> None:
        self.any_origin = "*" in g.allowed_origins
        self.origins = frozenset(o.strip().lower().rstrip("/") for o in g.allowed_origins)
        self.check_host = not keys_required and "*" not in g.allowed_hosts
        names = {h.strip().lower().rstrip(".") for h in g.allowed_hosts}
        if g.host and not _is_ip(g.host):
            names.add(g.host.lower())
        self.hosts = frozenset(names)

    def host_allowed(self, host_header: str | None) -> bool:
        if not host_header:
            return True  # HTTP/1.0 clients; browsers always send one
        host, _ = split_host(host_header)
        return (
            _is_ip(host) or host == "localhost" or host.endswith(".localhost") or host in self.hosts
        )

    def same_origin(self, origin: str, host_header: str | None) -> bool:
        """The origin's host and port are the request's ``Host``. A ``Host`` without a port
        matches on the name alone: proxies that pass ``$host`` (nginx) drop the port."""
        if not host_header:
            return False
        try:
            o = urlsplit(origin)
            name, port = o.hostname or "", o.port or _DEFAULT_PORTS.get(o.scheme)
        except ValueError:
            return False
        host, host_port = split_host(host_header)
        return bool(name) and name == host and host_port in (None, port)

    def listed(self, origin: str) -> bool:
        return self.any_origin or origin.strip().lower().rstrip("/") in self.origins

    def middleware(self) -> Middleware:
        @web.middleware
        async def browser_guard(request: web.Request, handler: Handler) -> web.StreamResponse:
            host = request.headers.get("Host")
            if (
                self.check_host
                and request.path not in UNCHECKED_HOST_PATHS
                and not self.host_allowed(host)
            ):
                raise APIError(
                    403,
                    "host_not_allowed",
                    f"Host {host!r} is not this server's (no API key is configured, so only "
                    "IP addresses, localhost and gateway.allowed_hosts are served)",
                )
            origin = request.headers.get("Origin")
            if origin is None or self.same_origin(origin, host):
                return await handler(request)
            if not self.listed(origin):
                raise APIError(
                    403,
                    "origin_not_allowed",
                    f"Origin {origin!r} is not allowed: pages of other sites may not use this "
                    "server (add it to gateway.allowed_origins)",
                )
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
            if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:
                return web.Response(
                    status=204,
                    headers={
                        **cors,
                        "Access-Control-Allow-Methods": CORS_METHODS,
                        "Access-Control-Allow-Headers": CORS_HEADERS,
                        "Access-Control-Max-Age": "600",
                    },
                )
            request[CORS_KEY] = cors
            return await handler(request)

        return browser_guard


CORS_KEY = web.RequestKey("cors_headers", dict)


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the CORS headers of an allowed foreign origin, on every
    response to it (streamed ones too)."""
    if (cors := request.get(CORS_KEY)) is not None:
        response.headers.update(cors)
