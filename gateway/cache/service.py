"""The gateway's sentence audio cache (``Gateway.cache``): a unit's key, its lookup and its
store, run off the event loop, counted, and never failing a request.

``gateway.requests`` asks ``lookup`` before admission (a hit streams at once and takes no
engine slot) and ``store`` once a miss's worker stream ended whole and its client has it.
Disk errors are counted (``orpheus_gateway_cache_errors``) and logged once a minute; the
request goes on as a miss.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.config import ServeConfig
from gateway.cache.fleet import FleetCache
from gateway.cache.flight import FlightReader, Joined
from gateway.cache.keys import NODE_SCOPE, UnitKey, checkpoint_identity
from gateway.cache.metrics import CacheMetrics
from gateway.cache.node import NodeCache, SweepResult
from gateway.cache.relay import FlightRelay, FlightWrites
from gateway.cache.units import unit_text
from shm.messages import SamplingOverrides
from shm.records import StreamError
from store.voices import resolve_state_dir

log = logging.getLogger(__name__)

SWEEP_EVERY_S = 60.0
"""A process sweeps the node's entries at least this often while it stores (TTL, sightings,
the byte bound as other processes' writes moved it)."""
_LOG_EVERY_S = 60.0


def cache_dir(config: ServeConfig) -> Path:
    """``cache.dir``, or ``audio-cache/`` in ``voices.state_dir``."""
    c = config.cache
    if c.dir:
        return resolve_state_dir(c.dir)
    return resolve_state_dir(config.voices.state_dir) / "audio-cache"


class AudioCache:
    def __init__(
        self,
        config: ServeConfig,
        metrics: CacheMetrics,
        voice_version: Callable[[str], str],
    ) -> None:
        c = config.cache
        self.node = NodeCache(
            cache_dir(config), max_bytes=c.max_bytes, ttl_s=c.ttl_s, admit_after=c.admit_after
        )
        self.shared = c.scope == "node"
        self.model = checkpoint_identity(config.llm.model)
        self.codec = checkpoint_identity(config.codec.model)
        self.metrics = metrics
        self.fleet = FleetCache(c.fleet_url, c.ttl_s) if c.fleet_url else None
        """The fleet's shared entries (Valkey), asked when the node misses; None: none."""
        self._voice_version = voice_version
        self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="audio-cache-read")
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audio-cache-write")
        """Writes (fsync, sweeps) in one thread of their own: lookups never wait behind them,
        and one sweep runs at a time."""
        self._flight_io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="audio-cache-flight")
        """The logs of the flights this process leads (``gateway.cache.relay``), in order, in a
        thread of their own: its followers never wait behind an entry's fsync."""
        self.node_flights = config.gateway.processes > 1
        """Single flight across the node's gateway processes (``lead``, ``follow``): only
        where there are others. A log costs its leader's process a write per chunk (about
        0.08 s of CPU per second at 500 synthesised streams, docs/performance.md); with one
        process every twin is in it and follows in memory."""
        self._flight_writes = FlightWrites(self._flight_io)
        """Every leader's chunks, to that thread in batches."""
        self._relays: weakref.WeakSet[FlightRelay] = weakref.WeakSet()
        """Its leaders' relays (each held by its stream until its end), ended at ``close``."""
        self._pending: set[asyncio.Future[object]] = set()
        self._logged_at = -_LOG_EVERY_S

    def key(self, tenant: str, text: str, voice: str, sampling: SamplingOverrides) -> UnitKey:
        """The key of the unit ``text`` (final: as the model reads it) spoken by ``voice``
        with ``sampling`` for ``tenant`` (the API key; the node's scope when shared)."""
        return UnitKey(
            NODE_SCOPE if self.shared else tenant,
            self.model,
            self.codec,
            voice,
            self._voice_version(voice),
            unit_text(text),
            sampling,
        )

    def _failed(self, what: str, e: BaseException) -> None:
        self.metrics.errors.inc()
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            log.warning("sentence audio cache: %s failed (%s); going on without it", what, e)

    async def lookup(self, key: UnitKey) -> bytes | None:
        """The unit's PCM if the cache has it (not counted: ``count`` the request's result)."""
        loop = asyncio.get_running_loop()
        try:
            pcm = await loop.run_in_executor(self._reads, self.node.get, key.tenant, key.digest())
        except Exception as e:  # a failing cache never fails a request
            self._failed("a lookup", e)
            pcm = None
        if pcm is None and self.fleet is not None:
            pcm = await self.fleet.get(key.tenant, key.digest())
            if pcm is not None:  # the next repeat on this node is local
                self.metrics.fleet_hits.inc()
                self._write(self.node.put, key.tenant, key.digest(), pcm, force=True)
        return pcm

    # -- single flight across the node's gateway processes (``gateway.cache.flight``) --------
    def lead(self, key: UnitKey) -> FlightRelay | None:
        """The log of the unit's synthesis, which this process leads: its followers in the
        node's other processes read it (``PcmStream.relay``). None with one gateway process:
        no other process would read it (``node_flights``)."""
        if not self.node_flights:
            return None
        tenant_dir = self.node.tenant_dir(key.tenant)
        relay = FlightRelay(self._flight_writes, tenant_dir, key.digest(), self._failed)
        self._relays.add(relay)
        return relay

    async def follow(self, key: UnitKey) -> Joined | None:
        """The flight of the unit that another gateway process of the node leads, joined;
        None: none (or one that cannot be followed: this request synthesises)."""
        if not self.node_flights:
            return None
        loop = asyncio.get_running_loop()
        directory, digest = self.node.tenant_dir(key.tenant), key.digest()
        try:
            return await loop.run_in_executor(self._reads, FlightReader.open, directory, digest)
        except Exception as e:  # a failing cache never fails a request
            self._failed("a flight's lookup", e)
            return None

    def count(self, result: str) -> None:
        """A request's lookup result: ``hit``, ``join``, ``partial``, ``miss`` or ``bypass``."""
        self.metrics.by_result[result].inc()

    def store(self, key: UnitKey, pcm: bytes, *, force: bool = False) -> None:
        """Count a synthesis of the unit and store its ``pcm`` if admitted (or ``force``: the
        request asked for new audio, ``no-cache``), in the background."""
        loop = asyncio.get_running_loop()
        tenant, digest = key.tenant, key.digest()
        fut = loop.run_in_executor(self._writes, self._store, tenant, digest, pcm, force)
        self._pending.add(fut)
        fut.add_done_callback(lambda f: self._stored(f, tenant, digest, pcm))

    def _write(self, fn: Callable[..., object], *args: object, force: bool = False) -> None:
        """``fn(*args, force=force)`` in the writer thread, its failure counted."""
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self._writes, lambda: fn(*args, force=force))
        self._pending.add(fut)
        fut.add_done_callback(self._written)

    def _written(self, fut: asyncio.Future[object]) -> None:
        self._pending.discard(fut)
        if not fut.cancelled() and (e := fut.exception()) is not None:
            self._failed("a copy from the fleet", e)

    def _store(
        self, tenant: str, digest: str, pcm: bytes, force: bool
    ) -> tuple[bool, SweepResult | None]:
        node = self.node
        if not force:
            node.sighted(tenant, digest)
        swept_at = node.swept_at
        written = node.put(tenant, digest, pcm, force=force)
        if node.swept_at == swept_at and time.time() - swept_at > SWEEP_EVERY_S:
            node.sweep()
        return written, node.last_sweep if node.swept_at != swept_at else None

    def _stored(
        self,
        fut: asyncio.Future[tuple[bool, SweepResult | None]],
        tenant: str,
        digest: str,
        pcm: bytes,
    ) -> None:
        self._pending.discard(fut)
        if fut.cancelled():
            return
        if (e := fut.exception()) is not None:
            self._failed("a store", e)
            return
        written, swept = fut.result()
        if written:
            self.metrics.stores.inc()
            if self.fleet is not None:
                task = asyncio.ensure_future(self.fleet.put(tenant, digest, pcm))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)
        if swept is not None:
            self._swept(swept)

    def _swept(self, r: SweepResult) -> None:
        self.metrics.evictions.inc(r.evicted)
        self.metrics.entries.set(r.entries)
        self.metrics.bytes.set(r.bytes)

    async def start(self) -> None:
        """A first sweep: the node's entries and bytes as they are (another process's, or
        this node's before a restart)."""
        loop = asyncio.get_running_loop()
        try:
            self._swept(await loop.run_in_executor(self._writes, self.node.sweep))
        except Exception as e:
            self._failed("the first sweep", e)

    async def purge(self, key: str, also: Sequence[str] = ()) -> int:
        """Remove every entry of API key ``key`` and of the tenants ``also`` (its jobs');
        how many there were."""
        loop = asyncio.get_running_loop()
        tenants = [NODE_SCOPE] if self.shared else [key, *also]
        n = 0
        for tenant in tenants:
            n += await loop.run_in_executor(self._writes, self.node.purge, tenant)
            if self.fleet is not None:
                await self.fleet.purge(tenant)
        return n

    async def purge_all(self) -> int:
        """Remove every entry of the node; how many there were."""
        loop = asyncio.get_running_loop()
        n = await loop.run_in_executor(self._writes, self.node.purge_all)
        if self.fleet is not None:
            await self.fleet.purge(None)
        return n

    async def close(self) -> None:
        """Let the stores under way finish (they are whole or not at all either way)."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=5.0)
        for relay in list(self._relays):  # a leader still synthesising: its followers fail
            relay.done(StreamError("shutdown", "the gateway stopped", 503))
        await asyncio.get_running_loop().run_in_executor(None, self._flight_io.shutdown)
        if self.fleet is not None:
            await self.fleet.close()
        self._reads.shutdown(wait=False)
        self._writes.shutdown(wait=False)
