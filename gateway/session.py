"""One admitted stream as a front end drives it (``Session``), and how a stream ended.

A front end opens a session with ``Gateway.open_session`` (``gateway.service``)::

    async with gateway.open_session(params, api="http") as session:
        while chunks := await session.stream.next_chunks():
            ...write them, calling session.sent(n) ...
        session.completed = True

Entering admits the request (or raises ``APIError`` 429/503), allocates a stream id and
sends ``LlmSubmit``; leaving frees the slot, cancels upstream work if the stream had not
finished, and records the outcome (``outcome_of``).
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import TYPE_CHECKING

from gateway.errors import APIError
from gateway.schemas import SpeechParams, check_text
from gateway.streams import PcmStream
from gateway.upstream import UpstreamUnavailable
from shm.records import SAMPLE_RATE, StreamError

if TYPE_CHECKING:
    from gateway.service import Gateway

BYTES_PER_SECOND = SAMPLE_RATE * 2
BYTES_METRIC_BATCH = 64 * 1024


def outcome_of(error: StreamError) -> str:
    """The ``outcome`` label of a stream that failed with ``error``."""
    if error.code in ("slow_client", "worker_restarted", "shutdown"):
        return error.code
    if error.code in ("cancelled", "client_disconnected"):
        return "cancelled"
    if error.code == "upstream_timeout":
        return "timeout"
    return "bad_request" if 400 <= error.status < 500 else "upstream_error"


def session_outcome(session: Session, exc: BaseException | None) -> str:
    """The ``outcome`` label of a session that is being left (with ``exc``, if raised)."""
    if session.completed:
        return "ok"
    if session.stream.error is not None:
        return outcome_of(session.stream.error)
    if exc is None or isinstance(exc, asyncio.CancelledError | ConnectionError):
        return "cancelled"
    if isinstance(exc, APIError):
        return "bad_request" if exc.status < 500 else "upstream_error"
    return "internal_error"


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
        stream.last_record_at = self._gateway.loop.time()  # the open text's idle clock too
        try:
            self._gateway.control.append_text(stream.stream_id, text, final=final)
        except UpstreamUnavailable as e:
            raise APIError(503, "upstream_unavailable", str(e)) from None
        if final:
            stream.text_closed = True

    def drop(self, why: str) -> None:
        """Drop a client that stopped reading: fail the stream and tear down the connection."""
        self.write_started = 0.0
        self._gateway.registry.drop_slow_client(self.stream, why)
