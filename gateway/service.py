"""The gateway's service: the state of one gateway process, shared by every front end.

``Gateway`` owns admission, the stream registry and the PCM pump, the cluster state, the
watchdog and the drain. Front ends (``gateway.frontends``) build a request into
``SpeechParams`` (``gateway.schemas.build_params``), then drive it as an ``ActiveRequest``
opened with ``Gateway.requests.open`` (``gateway.requests``, the owner of a request's life)
on the ``ClientLink`` of its connection (``Gateway.links.open``, ``gateway.link``: every
write to the client);
``/ready`` and the admission gate come from ``gateway.admission.readiness``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING

from common.config import ServeConfig
from common.limits import RequestLimits
from gateway.admission.capacity import INITIAL_LIMIT, CapacityController
from gateway.admission.cluster import ClusterWatcher, worker_lost
from gateway.admission.queue import Admission, KeyLimits
from gateway.admission.readiness import Readiness, draining_error, readiness, refusal
from gateway.cache.metrics import CacheMetrics
from gateway.cache.service import AudioCache
from gateway.errors import APIError
from gateway.link import ClientLinks
from gateway.metrics import GatewayMetrics
from gateway.pcm_pump import pump_pcm
from gateway.requests import BYTES_PER_SECOND, RequestTracker
from gateway.streams import StreamRegistry
from gateway.text.service import SpeechText
from gateway.upstream import Upstream
from gateway.voices.catalogue import ENGLISH_VOICES, VoiceCatalog
from gateway.voices.custom import CustomVoices
from gateway.voices.languages import VoiceLanguages
from shm.admission import AdmissionBoard
from shm.layout import InstanceLayout
from shm.messages import ClusterStatus
from shm.records import StreamError
from shm.ring import RingReader

if TYPE_CHECKING:
    from common.tracing import Tracing

log = logging.getLogger(__name__)

WATCHDOG_PERIOD_S = 0.25


class Gateway:
    """The state of one gateway process; ``start`` it inside the event loop that serves."""

    def __init__(
        self,
        config: ServeConfig,
        layout: InstanceLayout,
        index: int,
        metrics: GatewayMetrics,
        tracing: Tracing | None = None,
    ) -> None:
        g = config.gateway
        self.tracing = tracing
        """The process's OpenTelemetry tracer (``common.tracing``); None: tracing is off."""
        self.config = config
        self.layout = layout
        self.index = index
        self.metrics = metrics
        model_voices = config.llm.voices or list(ENGLISH_VOICES)
        self.custom_voices = CustomVoices(
            config, layout, model_voices, list(g.voice_aliases), self._ready_engines
        )
        self.voices = VoiceCatalog(
            g.voice_aliases,
            model_voices,
            config.llm.default_voice,
            self.custom_voices.is_lora,
            self.custom_voices.is_custom,
        )
        self.speech_text = SpeechText(config)
        """Normalisation and pronunciation dictionaries (``gateway.text``)."""
        self.languages = VoiceLanguages(config, self.custom_voices.language_of)
        """The languages of the checkpoint and its voices: a request's default language."""
        self.limits = RequestLimits.of(config.llm)
        """The sampling fields' limits, the llm_worker's (``build_params`` checks them)."""
        self.upstream = Upstream([layout.engine_control(e) for e in range(layout.engines)])
        """Every stream's life in the llm workers: the one sender of its submit, appends and
        cancel, each to its engine's control channel."""
        self.registry = StreamRegistry(
            index,
            self.upstream.stream_left,
            metrics,
            max_buffered_bytes=int(g.max_buffered_seconds * BYTES_PER_SECOND),
            retry_after_s=g.retry_after_s,
        )
        learned = g.admission == "learned"
        self.capacity = (
            CapacityController(
                layout.engines,
                margin=g.realtime_margin,
                ttfb_budget_s=g.ttfb_budget_s,
                initial=INITIAL_LIMIT,
                upper=math.ceil(g.max_active_streams / layout.engines),
                bytes_per_second=BYTES_PER_SECOND,
            )
            if learned
            else None
        )
        """Learns each engine's real-time limit from the streams' audio (learned admission)."""
        self._wait_s = g.ttfb_budget_s
        self.admission = Admission(
            g.max_active_streams,
            g.max_queued_streams,
            g.queue_timeout_s,
            g.retry_after_s,
            self._gate,
            # With several gateway processes the limits are the node's (shm/admission.py).
            AdmissionBoard(layout.admission_segment, layout.gateways, index)
            if layout.shared_admission
            else None,
            engines=layout.engines,
            ready_engines=self._ready_engines,
            learned=learned,
            initial_limit=INITIAL_LIMIT,
            wait_budget=(lambda: self._wait_s) if learned else None,
            key_limits=KeyLimits(g.max_streams_per_key, g.key_max_streams),
            key_weights=g.key_weights,
            early_refusal=g.early_refusal and not config.cache.enabled,
        )
        self.cluster = ClusterWatcher(layout.status)
        self.cluster.on_change(self._on_status)
        self.cache = (
            AudioCache(config, CacheMetrics(metrics.registry), self.custom_voices.version_of)
            if config.cache.enabled
            else None
        )
        """The sentence audio cache (``gateway.cache``, ``[cache]``); None: off."""
        self.requests = RequestTracker(
            g, self.admission, self.registry, self.upstream, self.metrics, tracing, self.cache
        )
        """The owner of every request's life: ``gateway.requests.open(...)``."""
        self.links = ClientLinks(metrics)
        """Every client connection's writes: ``gateway.links.open(api, on_abort)``."""
        self.draining = False
        self._tasks: list[asyncio.Task[None]] = []
        self._reader: RingReader | None = None
        self._closing = False
        self.broken: asyncio.Future[str]
        """Resolved (with why) when a background task this gateway cannot serve without
        ended: the process must stop and be restarted, not go on looking healthy."""
        self.loop: asyncio.AbstractEventLoop

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.requests.start(self.loop)
        self.links.start(self.loop)
        shm = self.config.shm
        self._reader = RingReader(
            self.layout.pcm_ring(self.index), spin_us=shm.spin_us, recheck_ms=shm.recheck_ms
        )
        self.broken = self.loop.create_future()
        self._tasks = [
            asyncio.create_task(pump_pcm(self._reader, self.registry), name="pcm-pump"),
            asyncio.create_task(self.cluster.run(), name="cluster-status"),
            asyncio.create_task(self._watchdog(), name="stream-watchdog"),
        ]
        for t in self._tasks:
            t.add_done_callback(self._task_ended)
        if self.cache is not None:
            await self.cache.start()

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A background task ended. Each runs until ``close``: ending before it is a bug that
        would leave the gateway admitting streams it cannot serve (no audio, or no news of
        a worker's restart), so the gateway reports it and stops."""
        if self._closing or self.broken.done():
            return
        exc = None if task.cancelled() else task.exception()
        why = f"the gateway's {task.get_name()} task ended" + (f": {exc!r}" if exc else "")
        log.error("%s; stopping this gateway (the orchestrator restarts it)", why, exc_info=exc)
        self.broken.set_result(why)

    async def close(self) -> None:
        """Fail what is still open, stop the background tasks, release ring and sockets."""
        self._closing = True
        self.begin_drain()
        self._fail_everything("shutdown", "the gateway stopped")
        self.requests.close()
        for t in self._tasks:
            t.cancel()
        # A task that ended with an error was reported by ``_task_ended``.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.upstream.close()
        self.admission.close()
        if self.cache is not None:
            await self.cache.close()

    def begin_drain(self) -> None:
        """Admit nothing more (503); queued requests are refused now."""
        if self.draining:
            return
        log.info("draining: no new streams; %d active", len(self.requests))
        self.draining = True
        self.admission.refuse_waiting(self._draining_error())

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to ``timeout_s`` for active streams. True if all finished."""
        self.begin_drain()
        deadline = self.loop.time() + timeout_s
        while self.requests.active and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.requests.active:
            return True
        log.warning("drain timeout: aborting %d streams", len(self.requests))
        self._fail_everything("shutdown", "the server is shutting down")
        end = self.loop.time() + 1.0
        while self.requests.active and self.loop.time() < end:
            await asyncio.sleep(0.02)
        return False

    def _fail_everything(self, code: str, message: str) -> None:
        self.registry.fail_all(StreamError(code, message, 503))
        self.links.abort_writers()

    # -- state -----------------------------------------------------------------------------
    @property
    def active_streams(self) -> int:
        return len(self.requests)

    def _draining_error(self) -> APIError:
        return draining_error(self.config.gateway.retry_after_s)

    def _ready_engines(self) -> tuple[bool, ...]:
        status = self.cluster.status
        if status is None:
            return (False,) * self.layout.engines
        return status.ready_engines

    def capacity_gauge(self) -> float:
        """What ``orpheus_gateway_capacity`` shows: the streams the node admits now, or, while
        none of its ready engines holds one stream in real time (learned admission), the part
        of one stream they hold (below 1: the machine is too slow for real time)."""
        capacity = self.admission.capacity()
        if self.capacity is None:
            return capacity
        ready = self._ready_engines()
        short = [
            held for e, held in enumerate(self.capacity.below_one) if e < len(ready) and ready[e]
        ]
        if short and all(held is not None for held in short):
            return sum(held for held in short if held is not None)
        return capacity

    def _gate(self) -> APIError | None:
        return refusal(self.cluster.status, self.draining, self.config.gateway.retry_after_s)

    def readiness(self) -> Readiness:
        return readiness(
            self.cluster.status,
            self.draining,
            self.admission.node_counts(),  # the node's, over every gateway
            self.admission.capacity(),  # the ready engines' shares
        )

    def _on_status(self, status: ClusterStatus) -> None:
        old = self.cluster.status
        lost = worker_lost(old, status)
        if lost:
            why = lost.describe()
            n = self.registry.fail_all(
                StreamError("worker_restarted", f"{why}; the stream was lost, retry it", 503),
                engines=None if lost.codec else lost.engines,
            )
            log.warning("%s: failed %d streams in flight", why, n)
        if old is not None and any(
            now and not was
            for was, now in zip(old.ready_engines, status.ready_engines, strict=False)
        ):
            # An engine came (back): queued requests may be placed on it. ``cluster.status``
            # is this status only after this callback, so look again on the next loop turn.
            self.loop.call_soon(self.admission.reconsider)

    def _learn(self, now: float) -> None:
        """The capacity controller's tick: this period's samples, the limits they give."""
        assert self.capacity is not None
        node = self.admission.node_by_engine()
        opinions = self.capacity.tick(self.registry.streams(), node, now)
        self._wait_s = self.capacity.wait_budget_s(node, now)
        self.admission.learn(opinions)

    async def _watchdog(self) -> None:
        g = self.config.gateway
        idle_s = g.upstream_idle_timeout_s
        text_idle_s = g.zmq_text_idle_timeout_s
        stall_s = g.client_stall_timeout_s
        upstream_timeout = StreamError(
            "upstream_timeout", f"no audio from the workers for {idle_s:g} s", 504
        )
        text_timeout = StreamError(
            "timeout",
            f"no text appended and nothing spoken for {text_idle_s:g} s; "
            "the text's last append must have final=true",
            408,
        )
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = self.loop.time()
            if self.capacity is not None:
                self._learn(now)
            self.links.sweep(now, stall_s)
            self.requests.sweep(
                now,
                idle_s=idle_s,
                text_idle_s=text_idle_s,
                upstream_timeout=upstream_timeout,
                text_timeout=text_timeout,
            )
