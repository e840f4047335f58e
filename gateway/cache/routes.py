"""The cache's HTTP routes (added by ``gateway.app`` when ``cache.enabled``):

- ``DELETE /v1/cache``: remove the calling API key's entries (its requests' and its jobs'),
  node-wide; answers ``{"purged": N}``. Under ``cache.scope = "node"`` the entries are the
  node's, not a key's: 409 ``cache_shared``, use the admin route;
- ``DELETE /v1/admin/cache``: remove every entry of the node (an admin key).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from aiohttp import web

from gateway.cache.service import AudioCache
from gateway.edge.auth import presented_key
from gateway.errors import APIError

PATH = "/v1/cache"
ADMIN_PATH = "/v1/admin/cache"


class Purged(msgspec.Struct, frozen=True):
    purged: int
    """Entries removed."""


def _answer(n: int) -> web.Response:
    return web.Response(body=msgspec.json.encode(Purged(n)), content_type="application/json")


def routes(cache: AudioCache, tenants_of: Callable[[str], list[str]]) -> list[web.RouteDef]:
    """``tenants_of(key)``: the key's other tenants (its jobs', ``gateway.cache.keys.
    job_tenant``), purged with it."""

    async def purge_own(request: web.Request) -> web.Response:
        if cache.shared:
            raise APIError(
                409,
                "cache_shared",
                "the cache is shared by the node (cache.scope = node): an admin purges it "
                f"with DELETE {ADMIN_PATH}",
            )
        key = presented_key(request)
        return _answer(await cache.purge(key, tenants_of(key)))

    async def purge_all(_: web.Request) -> web.Response:
        return _answer(await cache.purge_all())

    return [web.delete(PATH, purge_own), web.delete(ADMIN_PATH, purge_all)]
