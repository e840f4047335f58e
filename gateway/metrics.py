"""Prometheus metrics of a gateway process, and the ``/metrics`` exposition.

When ``PROMETHEUS_MULTIPROC_DIR`` is set (the orchestrator sets it for every child before
they import prometheus_client), each process writes its samples to files there and
``/metrics`` of any gateway aggregates all of them with ``MultiProcessCollector``: one
scrape carries every gateway's, the workers' and vLLM's (``vllm:*``) metrics.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.multiprocess import MultiProcessCollector

from gateway.apis import APIS, Api

__all__ = ["APIS", "OUTCOMES", "Api", "GatewayMetrics", "multiprocess_dir"]

OUTCOMES = (
    "ok",
    "rejected",
    "bad_request",
    "cancelled",
    "slow_client",
    "timeout",
    "worker_restarted",
    "upstream_error",
    "shutdown",
    "internal_error",
)


TTFB_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)
RTF_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.2, 1.5, 2.0, 5.0)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


class GatewayMetrics:
    """All gateway metrics, registered in ``registry`` (a private one per test)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.ttfb = Histogram(
            "orpheus_gateway_ttfb_seconds",
            "Time from request arrival to the first audio byte sent",
            ["api"],
            buckets=TTFB_BUCKETS,
            registry=registry,
        )
        self.rtf = Histogram(
            "orpheus_gateway_rtf",
            "Real-time factor of a finished stream: wall time / audio duration",
            ["api"],
            buckets=RTF_BUCKETS,
            registry=registry,
        )
        self.active = Gauge(
            "orpheus_gateway_active_streams",
            "Streams admitted and not yet finished",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.engine_active = Gauge(
            "orpheus_gateway_engine_active_streams",
            "Streams admitted and not yet finished, by the vLLM engine they were placed on",
            ["engine"],
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.queued = Gauge(
            "orpheus_gateway_queued_streams",
            "Requests waiting for an admission slot",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.saturation = Gauge(
            "orpheus_gateway_saturation",
            "Active streams over the streams the node can hold now (0..1; 1 while no engine is "
            "ready); node-wide, refreshed at every scrape",
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.capacity = Gauge(
            "orpheus_gateway_capacity",
            "Streams the node can hold now: with learned admission the streams its ready "
            "engines hold in real time, learned from their audio (at most "
            "gateway.max_active_streams); below 1 while no ready engine holds one stream in "
            "real time (the part of one it holds); node-wide, refreshed at every scrape",
            registry=registry,
            multiprocess_mode="livemostrecent",
        )
        self.requests = Counter(
            "orpheus_gateway_requests",
            "Speech requests by API and outcome",
            ["api", "outcome"],
            registry=registry,
        )
        self.bytes_sent = Counter(
            "orpheus_gateway_audio_bytes_sent",
            "Audio bytes written to clients (encoded, before transport framing)",
            ["api"],
            registry=registry,
        )
        self.slow_client_drops = Counter(
            "orpheus_gateway_slow_client_drops",
            "Streams dropped because the client did not read its audio",
            registry=registry,
        )
        self.orphan_records = Counter(
            "orpheus_gateway_orphan_records",
            "Ring records for streams the gateway no longer holds (cancelled or failed)",
            registry=registry,
        )
        self.sequence_errors = Counter(
            "orpheus_gateway_pcm_sequence_errors",
            "Streams failed because a PCM record arrived out of sequence",
            registry=registry,
        )
        self.control_send_failures = Counter(
            "orpheus_gateway_control_send_failures",
            "Control messages that could not be queued to the llm_worker",
            registry=registry,
        )
        self.connections_refused = Counter(
            "orpheus_gateway_connections_refused",
            "Connections refused (503) at the process's gateway.max_connections",
            registry=registry,
        )
        self.request_timeouts = Counter(
            "orpheus_gateway_request_timeouts",
            "Requests answered 408 because their header or body did not arrive in time",
            ["phase"],
            registry=registry,
        )
        self.jobs = Gauge(
            "orpheus_gateway_jobs",
            "Long-form jobs on the node's disk by state (every gateway reads the same directory)",
            ["state"],
            registry=registry,
            multiprocess_mode="max",
        )
        self.job_units = Counter(
            "orpheus_gateway_job_units",
            "Units of long-form jobs spoken and written to disk (rate: units per second)",
            registry=registry,
        )
        self.job_audio_seconds = Counter(
            "orpheus_gateway_job_audio_seconds",
            "Audio of long-form jobs' units written to disk, in seconds",
            registry=registry,
        )
        self.job_streams = Gauge(
            "orpheus_gateway_job_streams",
            "Streams job units hold now (they never take the last jobs.reserve_streams slots)",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.job_reserve_in_use = Gauge(
            "orpheus_gateway_jobs_reserve_in_use",
            "Slots of jobs.reserve_streams held by interactive streams (node, last look)",
            registry=registry,
            multiprocess_mode="max",
        )
        self.jobs_disk_bytes = Gauge(
            "orpheus_gateway_jobs_disk_bytes",
            "Bytes under jobs.dir (units' audio, final files, state)",
            registry=registry,
            multiprocess_mode="max",
        )
        self.header_timeouts = self.request_timeouts.labels("header")
        self.body_timeouts = self.request_timeouts.labels("body")
        # Pre-bound children: the per-chunk path does no label lookups.
        self.bytes_sent_by_api = {api: self.bytes_sent.labels(api) for api in APIS}
        self.ttfb_by_api = {api: self.ttfb.labels(api) for api in APIS}
        self.rtf_by_api = {api: self.rtf.labels(api) for api in APIS}
        self.requests_by = {
            (api, outcome): self.requests.labels(api, outcome)
            for api in APIS
            for outcome in OUTCOMES
        }

    def engine_gauges(self, engines: int) -> list[Gauge]:
        """``engine_active`` bound to each engine (the admission path does no lookups)."""
        return [self.engine_active.labels(str(e)) for e in range(engines)]

    def count_request(self, api: str, outcome: str) -> None:
        if outcome not in OUTCOMES:
            outcome = "upstream_error"
        self.requests_by[(api, outcome)].inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition of this process, or of every process in multiprocess mode."""
        if multiprocess_dir():
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
