"""The gateway's core, shared by every front end: admission, streams, cluster state, drain.

Front ends (HTTP, WebSocket, ZeroMQ) validate a request into ``SpeechParams`` and then::

    async with gateway.open_session(params, api="http") as session:
        while chunks := await session.stream.next_chunks():
            ...write them, calling session.sent(n) ...
        session.completed = True

``open_session`` admits the request (or raises ``APIError`` 429/503), allocates a stream
id and sends ``Submit``; leaving the block frees the slot, cancels upstream work if the
stream had not finished, and records the outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from types import TracebackType

import msgspec

from common.config import ServeConfig
from gateway.admission import Admission
from gateway.cluster import ClusterWatcher, worker_lost
from gateway.custom_voices import CustomVoices
from gateway.errors import APIError
from gateway.metrics import GatewayMetrics
from gateway.pcm_pump import pump_pcm
from gateway.schemas import SpeechParams, check_text
from gateway.streams import PcmStream, StreamRegistry
from gateway.upstream import ControlChannel, UpstreamUnavailable
from gateway.voices import ENGLISH_VOICES, VoiceCatalog
from shm.admission import AdmissionBoard
from shm.layout import InstanceLayout
from shm.messages import ClusterStatus
from shm.records import SAMPLE_RATE, StreamError
from shm.ring import RingReader

log = logging.getLogger(__name__)
stream_log = logging.getLogger("orpheus.streams")

WATCHDOG_PERIOD_S = 0.25
BYTES_PER_SECOND = SAMPLE_RATE * 2
BYTES_METRIC_BATCH = 64 * 1024


class Readiness(msgspec.Struct, frozen=True):
    """Body of ``GET /ready``."""

    ready: bool
    reasons: list[str]
    active_streams: int
    queued_streams: int
    max_active_streams: int
    draining: bool


def outcome_of(error: StreamError) -> str:
    if error.code in ("slow_client", "worker_restarted", "shutdown"):
        return error.code
    if error.code in ("cancelled", "client_disconnected"):
        return "cancelled"
    if error.code == "upstream_timeout":
        return "timeout"
    return "bad_request" if 400 <= error.status < 500 else "upstream_error"


class Session:
    """One admitted stream, as a front end drives it (see the module docstring)."""

    __slots__ = (
        "_gateway",
        "api",
        "bytes_sent",
        "bytes_unreported",
        "completed",
        "first_byte_at",
        "params",
        "started_at",
        "stream",
        "text_chars",
        "text_open",
        "write_started",
    )

    def __init__(
        self,
        gateway: Gateway,
        params: SpeechParams,
        api: str,
        started_at: float,
        text_open: bool,
    ) -> None:
        self._gateway = gateway
        self.params = params
        self.api = api
        self.text_open = text_open
        self.started_at = started_at
        self.first_byte_at: float | None = None
        self.bytes_sent = 0
        self.bytes_unreported = 0
        self.completed = False
        """Set by the front end once the client has everything (the outcome is then ok)."""
        self.text_chars = len(params.text)
        self.write_started = 0.0
        """Loop time at which a write to the client began and has not finished (0: none)."""
        self.stream: PcmStream  # set in __aenter__

    async def __aenter__(self) -> Session:
        await self._gateway._admit(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._gateway._finish(self, e)

    @property
    def audio_seconds(self) -> float:
        return self.stream.bytes_received / BYTES_PER_SECOND

    def sent(self, n: int) -> None:
        """Account ``n`` bytes of audio written to the client (TTFB on the first)."""
        if n <= 0:
            return
        if self.first_byte_at is None:
            self.first_byte_at = now = self._gateway.loop.time()
            self._gateway.metrics.ttfb_by_api[self.api].observe(now - self.started_at)
        self.bytes_sent += n
        self.bytes_unreported += n
        if self.bytes_unreported >= BYTES_METRIC_BATCH:
            self.report_bytes()

    def report_bytes(self) -> None:
        """Add the bytes sent so far to the counter (batched: a locked update per chunk costs)."""
        if self.bytes_unreported:
            self._gateway.metrics.bytes_sent_by_api[self.api].inc(self.bytes_unreported)
            self.bytes_unreported = 0

    def append_text(self, text: str, *, final: bool) -> None:
        """More text for a stream opened with ``text_open`` (WebSocket, ZeroMQ)."""
        stream = self.stream
        if stream.text_closed:
            raise APIError(400, "text_closed", "this stream's text is already complete")
        limit = self._gateway.config.gateway.max_input_chars
        if self.text_chars + len(text) > limit:
            raise APIError(
                400,
                "input_too_long",
                f"the stream's text would reach {self.text_chars + len(text)} characters; "
                f"the limit is {limit}",
                param="text",
            )
        check_text(text, limit, param="text", allow_empty=True)
        self.text_chars += len(text)
        if stream.done:
            return  # ended or failed meanwhile: the front end learns it from next_chunks
        try:
            self._gateway.control.append_text(stream.stream_id, text, final=final)
        except UpstreamUnavailable as e:
            raise APIError(503, "upstream_unavailable", str(e)) from None
        if final:
            stream.text_closed = True
            stream.last_record_at = self._gateway.loop.time()

    def drop(self, why: str) -> None:
        """Drop a client that stopped reading: fail the stream and tear down the connection."""
        self.write_started = 0.0
        self._gateway.registry.drop_slow_client(self.stream, why)


class Gateway:
    """The state of one gateway process; ``start`` it inside the event loop that serves."""

    def __init__(
        self,
        config: ServeConfig,
        layout: InstanceLayout,
        index: int,
        metrics: GatewayMetrics,
    ) -> None:
        g = config.gateway
        self.config = config
        self.layout = layout
        self.index = index
        self.metrics = metrics
        self.voices = VoiceCatalog(
            g.voice_aliases, config.llm.voices or list(ENGLISH_VOICES), config.llm.default_voice
        )
        self.custom_voices = CustomVoices(
            config, layout, self.voices.model_voices, list(g.voice_aliases)
        )
        self.control = ControlChannel(layout.control)
        self.registry = StreamRegistry(
            index,
            self.control,
            metrics,
            max_buffered_bytes=int(g.max_buffered_seconds * BYTES_PER_SECOND),
        )
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
        )
        self.cluster = ClusterWatcher(layout.status, self._on_status)
        self.draining = False
        self._sessions: set[Session] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self._reader: RingReader | None = None
        self.loop: asyncio.AbstractEventLoop

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        shm = self.config.shm
        self._reader = RingReader(
            self.layout.pcm_ring(self.index), spin_us=shm.spin_us, recheck_ms=shm.recheck_ms
        )
        self._tasks = [
            asyncio.create_task(pump_pcm(self._reader, self.registry), name="pcm-pump"),
            asyncio.create_task(self.cluster.run(), name="cluster-status"),
            asyncio.create_task(self._watchdog(), name="stream-watchdog"),
        ]

    async def close(self) -> None:
        """Fail what is still open, stop the background tasks, release ring and sockets."""
        self.begin_drain()
        self._fail_everything("shutdown", "the gateway stopped")
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks.clear()
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.control.close()
        self.admission.close()

    def begin_drain(self) -> None:
        """Admit nothing more (503); queued requests are refused now."""
        if self.draining:
            return
        log.info("draining: no new streams; %d active", len(self._sessions))
        self.draining = True
        self.admission.refuse_waiting(self._draining_error())

    async def drain(self, timeout_s: float) -> bool:
        """Stop admitting; wait up to ``timeout_s`` for active streams. True if all finished."""
        self.begin_drain()
        deadline = self.loop.time() + timeout_s
        while self._sessions and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self._sessions:
            return True
        log.warning("drain timeout: aborting %d streams", len(self._sessions))
        self._fail_everything("shutdown", "the server is shutting down")
        end = self.loop.time() + 1.0
        while self._sessions and self.loop.time() < end:
            await asyncio.sleep(0.02)
        return False

    def _fail_everything(self, code: str, message: str) -> None:
        self.registry.fail_all(StreamError(code, message, 503), cancel_upstream=True)
        for session in list(self._sessions):
            if session.stream.on_abort is not None and session.write_started:
                session.stream.on_abort()

    # -- state -----------------------------------------------------------------------------
    @property
    def active_streams(self) -> int:
        return len(self._sessions)

    def _draining_error(self) -> APIError:
        return APIError(
            503,
            "draining",
            "the server is shutting down; retry on another instance",
            retry_after_s=self.config.gateway.retry_after_s,
        )

    def _gate(self) -> APIError | None:
        status = self.cluster.status
        if self.draining or (status is not None and status.draining):
            return self._draining_error()
        if status is None or not (status.llm_ready and status.codec_ready):
            return APIError(
                503,
                "workers_not_ready",
                "the model workers are not ready yet",
                retry_after_s=self.config.gateway.retry_after_s,
            )
        return None

    def readiness(self) -> Readiness:
        reasons: list[str] = []
        status = self.cluster.status
        if status is None:
            reasons.append("no status from the orchestrator yet")
        else:
            if not status.llm_ready:
                reasons.append("llm_worker not ready")
            if not status.codec_ready:
                reasons.append("codec_worker not ready")
            if status.draining:
                reasons.append("instance draining")
        if self.draining:
            reasons.append("gateway draining")
        active, queued = self.admission.node_counts()  # the node's, over every gateway
        if active >= self.admission.max_active:
            reasons.append(f"all {self.admission.max_active} stream slots busy")
        return Readiness(
            ready=not reasons,
            reasons=reasons,
            active_streams=active,
            queued_streams=queued,
            max_active_streams=self.admission.max_active,
            draining=self.draining,
        )

    def _on_status(self, status: ClusterStatus) -> None:
        why = worker_lost(self.cluster.status, status)
        if why is not None:
            n = self.registry.fail_all(
                StreamError("worker_restarted", f"{why}; the stream was lost, retry it", 503),
                cancel_upstream=True,
            )
            log.warning("%s: failed %d streams in flight", why, n)

    # -- sessions --------------------------------------------------------------------------
    def open_session(
        self,
        params: SpeechParams,
        api: str,
        *,
        text_open: bool = False,
        started_at: float | None = None,
    ) -> Session:
        t0 = self.loop.time() if started_at is None else started_at
        return Session(self, params, api, t0, text_open)

    async def _admit(self, session: Session) -> None:
        with self.metrics.queued.track_inprogress():
            try:
                await self.admission.acquire()
            except APIError:
                self.metrics.count_request(session.api, "rejected")
                raise
        params = session.params
        stream = self.registry.open(self.loop.time(), text_closed=not session.text_open)
        try:
            self.control.submit(
                stream.stream_id,
                params.text,
                params.voice,
                params.sampling,
                text_open=not stream.text_closed,
            )
        except UpstreamUnavailable as e:
            self.registry.fail(
                stream,
                StreamError("upstream_unavailable", str(e), 503),
                cancel_upstream=False,
                discard_pending=True,
            )
            self.admission.release()
            self.metrics.count_request(session.api, "upstream_error")
            raise APIError(
                503, "upstream_unavailable", str(e), retry_after_s=self.config.gateway.retry_after_s
            ) from None
        session.stream = stream
        self._sessions.add(session)
        self.metrics.active.inc()

    def _finish(self, session: Session, exc: BaseException | None) -> None:
        session.report_bytes()
        stream = session.stream
        if session.completed:
            outcome = "ok"
        elif stream.error is not None:
            outcome = outcome_of(stream.error)
        elif exc is None or isinstance(exc, asyncio.CancelledError | ConnectionError):
            outcome = "cancelled"
        elif isinstance(exc, APIError):
            outcome = "bad_request" if exc.status < 500 else "upstream_error"
        else:
            outcome = "internal_error"
        self.registry.release(
            stream, "client_disconnected" if outcome in ("cancelled", "ok") else outcome
        )
        elapsed = self.loop.time() - session.started_at
        audio_s = session.audio_seconds
        rtf = elapsed / audio_s if audio_s else None
        if outcome == "ok" and rtf is not None:
            self.metrics.rtf_by_api[session.api].observe(rtf)
        self.metrics.count_request(session.api, outcome)
        ttfb = session.first_byte_at - session.started_at if session.first_byte_at else None
        # One line per stream at its end (JSON lines carry the fields as keys).
        fields = {
            "stream_id": f"{stream.stream_id:#x}", "api": session.api, "outcome": outcome,
            "ttfb_s": None if ttfb is None else round(ttfb, 4),
            "rtf": None if rtf is None else round(rtf, 4), "audio_s": round(audio_s, 3),
            "bytes_sent": session.bytes_sent, "text_chars": session.text_chars,
        }  # fmt: skip
        stream_log.info(
            "stream %s %s: ttfb %s s, rtf %s, audio %.2f s", fields["stream_id"], outcome,
            fields["ttfb_s"], fields["rtf"], audio_s, extra={"fields": fields},
        )  # fmt: skip
        self._sessions.discard(session)
        self.metrics.active.dec()
        self.admission.release()

    async def _watchdog(self) -> None:
        g = self.config.gateway
        idle_s = g.upstream_idle_timeout_s
        stall_s = g.client_stall_timeout_s
        while True:
            await asyncio.sleep(WATCHDOG_PERIOD_S)
            now = self.loop.time()
            for session in list(self._sessions):
                stream = session.stream
                if not stream.done and stream.text_closed and now - stream.last_record_at > idle_s:
                    self.registry.fail(
                        stream,
                        StreamError(
                            "upstream_timeout", f"no audio from the workers for {idle_s:g} s", 504
                        ),
                        cancel_upstream=True,
                        discard_pending=True,
                    )
                started = session.write_started
                if started and now - started > stall_s:
                    session.drop(f"the client accepted no data for {stall_s:g} s")
