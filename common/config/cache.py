"""The sentence audio cache (the ``[cache]`` table): the PCM of each synthesis unit the
gateway sends to the model, kept on the node and served again to a repeat of the same unit
with the same voice, sampling and model (``gateway/cache/``; docs/api.md, "The sentence
audio cache")."""

from __future__ import annotations

from typing import Literal

import msgspec


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    enabled: bool = True
    """Serve repeated units from the cache and store new ones (off: every unit is
    synthesised, nothing is written). A request opts out with ``Cache-Control: no-store``
    (docs/api.md, "The sentence audio cache")."""
    scope: Literal["key", "node"] = "key"
    """``key``: entries belong to the API key that made them (no key ever hears another's
    sentences, nor learns from a hit's speed that another said them); ``node``: one entry
    serves every key of the node (shared stock phrases; only where the keys are one
    tenant's)."""
    dir: str = ""
    """Directory of the node's entries, shared by all its gateway processes. Empty:
    ``audio-cache/`` in ``voices.state_dir``."""
    max_bytes: int = 512 << 20
    """Bytes of PCM (24 kHz, 16-bit: 48 kB a second) the node's entries may take: 512 MiB
    hold about 3 hours of speech, 3,500 sentences of 3 s."""
    ttl_s: float = 7 * 86400.0
    """An entry older than this is never served (and is removed by the next sweep)."""
    fleet_url: str = ""
    """A Valkey (or Redis) server the nodes behind one load balancer share entries in
    (``valkey://host:6379/0``, ``redis://...``; ``gateway.cache.fleet``); empty: each node
    its own. A slow or absent server fails no request: the node's cache answers alone."""
    admit_after: int = 2
    """A unit is stored when it has been synthesised this many times within a day
    (2: on its second sight, so that a flood of one-off sentences does not push the
    greetings out; 1: every unit; bench/cache/policy.py measured the choice)."""
