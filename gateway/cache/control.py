"""What one request lets the cache do: read (serve a hit) and write (store its units).

- HTTP: the request's ``Cache-Control`` header: ``no-store`` neither reads nor writes,
  ``no-cache`` does not read (the units are synthesised again) and stores the new audio;
- ElevenLabs' ``enable_logging=false`` (its zero-retention mode): never stores (a hit of an
  entry another request of the key stored may still be served: nothing of this request is
  kept);
- the WebSocket protocols and ZeroMQ: a ``cache`` field, ``"use"`` (the default),
  ``"no-cache"`` or ``"no-store"``, with the header's meanings.

What the answer says: ``combined`` makes one state of the units a protocol's final message
covers (ElevenLabs' context, vLLM-Omni's sentence).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import msgspec

CacheField = Literal["use", "no-cache", "no-store"]


class CacheUse(msgspec.Struct, frozen=True):
    read: bool = True
    write: bool = True


USE = CacheUse()
NO_CACHE = CacheUse(read=False, write=True)
NO_STORE = CacheUse(read=False, write=False)
NO_LOGGING = CacheUse(read=True, write=False)

_BY_FIELD: dict[str, CacheUse] = {"use": USE, "no-cache": NO_CACHE, "no-store": NO_STORE}


def of_field(value: str | None) -> CacheUse:
    """The use of a protocol's ``cache`` field (None: ``use``); ValueError for another."""
    if value is None:
        return USE
    try:
        return _BY_FIELD[value]
    except KeyError:
        raise ValueError(f"cache must be one of {', '.join(_BY_FIELD)}, not {value!r}") from None


def of_header(cache_control: str | None) -> CacheUse:
    """The use of an HTTP request's ``Cache-Control`` header (None: absent)."""
    if not cache_control:
        return USE
    directives = {d.split("=", 1)[0].strip().lower() for d in cache_control.split(",")}
    if "no-store" in directives:
        return NO_STORE
    if "no-cache" in directives:
        return NO_CACHE
    return USE


def of_http(cache_control: str | None, enable_logging: str | None = None) -> CacheUse:
    """The use of an HTTP request or WebSocket upgrade: its ``Cache-Control`` header, then
    ElevenLabs' ``enable_logging`` query parameter (``false``: never stored)."""
    use = of_header(cache_control)
    if enable_logging is not None and enable_logging.strip().lower() == "false":
        use = without_logging(use)
    return use


def without_logging(use: CacheUse) -> CacheUse:
    """``use`` for a request that asked for zero retention (ElevenLabs' ``enable_logging``
    false): never written."""
    return CacheUse(read=use.read, write=False)


def combined(states: Iterable[str | None]) -> str | None:
    """The cache state of an answer made of units with these states (each a request's
    ``cache_state``): ``hit`` when every unit came from the cache, ``miss`` when none did,
    ``partial`` otherwise; None when no unit could be cached (the cache off, pauses alone):
    the protocol then says nothing, as before the cache. A unit that could not be cached
    (None) beside cacheable ones counts as synthesised."""
    seen = list(states)
    if all(s is None for s in seen):
        return None
    if all(s == "hit" for s in seen):
        return "hit"
    if all(s in ("miss", None) for s in seen):
        return "miss"
    return "partial"
