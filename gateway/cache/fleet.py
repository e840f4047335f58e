"""The fleet's cache: entries in a Valkey (or Redis) server that every node behind one load
balancer shares (``cache.fleet_url``, ``valkey://host:6379/0`` or ``redis://...``).

A node looks here only when its own cache misses, and stores here what it stored itself
(the node's admission rule decides); a fleet hit is copied into the node's cache, so the
next repeat is local. Keys are ``orpheus:cache:<tenant id>:<key digest>`` (the tenant id a
digest, as on disk), values the node's entry bytes (``gateway.cache.entry``: header and
checksum, so a value cut short or another key's is never served), with the TTL as the
server's expiry. The server's own ``maxmemory`` and eviction policy bound it
(docs/operations.md).

A slow or absent server fails nothing: every call waits at most ``TIMEOUT_S``, and after a
failure the fleet is not asked again for ``RETRY_S`` (the node's cache alone answers).
"""

from __future__ import annotations

import logging
import time

from gateway.cache import entry
from gateway.cache.node import tenant_id

log = logging.getLogger(__name__)

PREFIX = "orpheus:cache:"
TIMEOUT_S = 0.1
"""The longest a lookup or a store waits for the server (a miss costs this much more at
worst)."""
RETRY_S = 5.0
"""After a failure, how long the fleet is left alone."""


class FleetCache:
    def __init__(self, url: str, ttl_s: float) -> None:
        # Imported here: a gateway without a fleet (and an environment without the client,
        # as the vLLM 0.25.1 test environment may be) never loads it.
        import valkey.asyncio as valkey

        self.url = url
        self.ttl_s = ttl_s
        self._client = valkey.from_url(
            url, socket_timeout=TIMEOUT_S, socket_connect_timeout=TIMEOUT_S
        )
        self._down_until = 0.0
        self.failures = 0

    @staticmethod
    def name(tenant: str, digest: str) -> str:
        return f"{PREFIX}{tenant_id(tenant)}:{digest}"

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, e: BaseException) -> None:
        self.failures += 1
        if self.available:
            log.warning("fleet cache %s: %s failed (%r); the node's cache alone for %g s",
                        self.url, what, e, RETRY_S)  # fmt: skip
        self._down_until = time.monotonic() + RETRY_S

    async def get(self, tenant: str, digest: str) -> bytes | None:
        """The entry's PCM from the fleet; None when absent, damaged, expired or the server
        cannot answer in time."""
        if not self.available:
            return None
        try:
            data = await self._client.get(self.name(tenant, digest))
        except Exception as e:  # the fleet never fails a request
            self._failed("a lookup", e)
            return None
        if data is None:
            return None
        return entry.decode(digest, data, not_before=time.time() - self.ttl_s)

    async def put(self, tenant: str, digest: str, pcm: bytes) -> bool:
        if not self.available:
            return False
        data = entry.encode(digest, pcm, time.time())
        try:
            await self._client.set(self.name(tenant, digest), data, ex=max(1, int(self.ttl_s)))
        except Exception as e:
            self._failed("a store", e)
            return False
        return True

    async def purge(self, tenant: str | None) -> int:
        """Remove ``tenant``'s entries (None: every entry); how many."""
        match = PREFIX + ("*" if tenant is None else f"{tenant_id(tenant)}:*")
        n = 0
        try:
            async for name in self._client.scan_iter(match=match, count=500):
                n += await self._client.delete(name)
        except Exception as e:
            self._failed("a purge", e)
        return n

    async def close(self) -> None:
        try:
            await self._client.aclose()
        except Exception as e:  # closing a connection to a server that went away
            log.debug("fleet cache close: %r", e)
