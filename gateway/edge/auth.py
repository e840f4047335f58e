"""API keys: the one check every front end makes (``gateway.api_keys``), and the admin keys
of ``/v1/admin/*`` (``gateway.admin_keys``, which speech keys do not open).

HTTP and the WebSocket upgrades (a middleware on ``/v1/*``) and ZeroMQ (``Speak.api_key``)
compare the key a client presents with ``ApiKeys.allows``: in constant time (SHA-256 of
both sides, so not even the length of a key leaks), against every configured key, so that
the time taken says nothing about which key matched. No key configured: everything is
allowed. A refused request is 401 ``invalid_api_key``; the message says where the key goes
in that protocol.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from gateway.errors import APIError

HTTP_KEY_HINT = "missing or invalid API key (Authorization: Bearer ...)"
ZMQ_KEY_HINT = "missing or invalid api_key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    @property
    def required(self) -> bool:
        """Keys are configured: a request must present one of them."""
        return bool(self._digests)

    def allows(self, presented: str | None) -> bool:
        if not self._digests:
            return True
        if not presented:
            return False
        p = _digest(presented)
        ok = False
        for k in self._digests:  # every key, always: timing says nothing about which matched
            ok |= hmac.compare_digest(p, k)
        return ok

    def check(self, presented: str | None, hint: str) -> None:
        """APIError 401 unless ``presented`` is allowed."""
        if not self.allows(presented):
            raise APIError(401, "invalid_api_key", hint)


def presented_key(request: web.Request) -> str:
    """The API key an HTTP request carries, in whichever way its protocol sends it:
    ``Authorization: Bearer KEY`` (OpenAI), ``Authorization: Api-Key KEY`` (Baseten),
    ``xi-api-key: KEY`` (ElevenLabs), or, on a WebSocket upgrade (browsers cannot set its
    headers), ``?api_key=KEY``."""
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() in ("bearer", "api-key") and token.strip():
        return token.strip()
    if key := request.headers.get("xi-api-key", ""):
        return key.strip()
    if request.headers.get("Upgrade", "").lower() == "websocket":
        return request.query.get("api_key", "")
    return ""


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


ADMIN_PREFIX = "/v1/admin/"
JOBS_PREFIX = "/v1/audio/jobs"
"""Jobs take an API key or an admin key (which sees every key's jobs)."""
ADMIN_READABLE = "/v1/pronunciation-dictionaries"
"""Routes an admin key opens as well as an API key (what it sees there is every key's)."""
ADMIN_KEY_HINT = "missing or invalid admin key (Authorization: Bearer ...; gateway.admin_keys)"


def http_middleware(keys: ApiKeys, admin: ApiKeys, *, metrics: bool = False) -> Middleware:
    """The key checks: ``/v1/admin/*`` takes an admin key (403 ``admin_disabled`` when none
    is configured), ``ADMIN_READABLE`` either key, the rest of ``/v1/*`` an API key when
    some are configured, and, with
    ``metrics``, ``/metrics`` either. Other paths (health, readiness, the playground) are
    open. Its 401/403 are rendered by the JSON error middleware, which must come before it."""

    @web.middleware
    async def require_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith(ADMIN_PREFIX):
            if not admin.required:
                raise APIError(
                    403,
                    "admin_disabled",
                    "admin calls are off: set gateway.admin_keys (speech keys do not open them)",
                )
            admin.check(presented_key(request), ADMIN_KEY_HINT)
        elif path.startswith(ADMIN_READABLE):
            key = presented_key(request)  # an admin key sees (and manages) every key's
            if not (admin.required and admin.allows(key)):
                keys.check(key, HTTP_KEY_HINT)
        elif path.startswith("/v1/"):
            key = presented_key(request)
            if not (path.startswith(JOBS_PREFIX) and admin.required and admin.allows(key)):
                keys.check(key, HTTP_KEY_HINT)
        elif metrics and path == "/metrics":
            key = presented_key(request)
            if not (admin.required and admin.allows(key)):
                keys.check(key, HTTP_KEY_HINT)
        return await handler(request)

    return require_key
