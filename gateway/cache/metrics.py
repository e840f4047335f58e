"""The cache's Prometheus metrics (registered beside ``gateway.metrics``')."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

RESULTS = ("hit", "join", "partial", "miss", "bypass")


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter(
            "orpheus_gateway_cache_lookups",
            "Requests looked up in the sentence audio cache, by result (join: a twin being "
            "synthesised in the same gateway process was followed, a single flight; partial: "
            "its first sentences were cached, the rest was synthesised; bypass: the "
            "request's Cache-Control or its protocol's cache field skipped the lookup)",
            ["result"],
            registry=registry,
        )
        self.by_result = {r: self.lookups.labels(r) for r in RESULTS}
        self.fleet_hits = Counter(
            "orpheus_gateway_cache_fleet_hits",
            "Hits answered by the fleet's cache (cache.fleet_url) after the node's missed",
            registry=registry,
        )
        self.stores = Counter(
            "orpheus_gateway_cache_stores",
            "Units' audio written to the cache",
            registry=registry,
        )
        self.evictions = Counter(
            "orpheus_gateway_cache_evictions",
            "Entries removed to keep the cache within cache.max_bytes",
            registry=registry,
        )
        self.errors = Counter(
            "orpheus_gateway_cache_errors",
            "Cache reads or writes that failed (the request went on without the cache)",
            registry=registry,
        )
        self.entries = Gauge(
            "orpheus_gateway_cache_entries",
            "Entries in the node's cache at the last sweep",
            registry=registry,
            multiprocess_mode="max",
        )
        self.bytes = Gauge(
            "orpheus_gateway_cache_bytes",
            "Bytes of the node's cache entries at the last sweep (at most cache.max_bytes)",
            registry=registry,
            multiprocess_mode="max",
        )
