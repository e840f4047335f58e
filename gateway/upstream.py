"""A stream's life in the llm workers, and the gateway's control channels to them: a ZeroMQ
PUSH of msgpack Structs per vLLM engine (``llm.engines``), each to its worker's
``control-<engine>`` socket.

``Upstream`` is the one sender of every control message (``Gateway.upstream``): a stream's
submit and appends (``gateway.requests`` asks for them) and its cancel, each to the engine
the stream was placed on at admission (``gateway.admission``). It knows which worker streams
it started and whose END or ERROR has not come, so a cancel goes exactly once, and only to a
worker stream the workers hold: the stream registry tells it when a stream leaves its routes
(``gateway.streams``, ``StreamRegistry``'s ``on_leave``), with why when that is before its
worker stream ended (the stream failed, the client went away, the request left early).

Sends never block the event loop: a message that cannot be queued (the llm_worker is not
draining its socket and the high-water mark is reached) is reported to the caller, which
fails the request explicitly instead of waiting.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import zmq

from shm.messages import (
    LlmAppendText,
    LlmCancel,
    LlmControl,
    LlmSubmit,
    control_encoder,
)

if TYPE_CHECKING:
    from gateway.schemas import SpeechParams
    from gateway.streams import PcmStream

log = logging.getLogger(__name__)

CONTROL_SNDHWM = 10_000


class UpstreamUnavailable(Exception):
    """The control message could not be queued to the llm_worker."""


class ControlChannel:
    def __init__(self, endpoint: str, ctx: zmq.Context | None = None) -> None:
        self._sock = (ctx or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, CONTROL_SNDHWM)
        self._sock.connect(endpoint)
        self.failures = 0

    def _send(self, msg: LlmControl) -> None:
        try:
            self._sock.send(control_encoder.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self.failures += 1
            raise UpstreamUnavailable("the llm_worker is not accepting control messages") from None

    def send(self, msg: LlmControl) -> None:
        """Queue one control message. Raises ``UpstreamUnavailable``."""
        self._send(msg)

    def append_text(self, stream_id: int, text: str, *, final: bool) -> None:
        self._send(LlmAppendText(stream_id=stream_id, text=text, final=final))

    def cancel(self, stream_id: int, reason: str) -> None:
        """Best effort: a lost Cancel only costs the worker some wasted generation."""
        try:
            self._send(LlmCancel(stream_id=stream_id, reason=reason))
        except UpstreamUnavailable:
            log.warning("could not queue Cancel for stream %#x (%s)", stream_id, reason)

    def close(self) -> None:
        self._sock.close(linger=0)


class Upstream:
    """The one owner of every stream's life in the llm workers: its submit, its appends and
    its cancel, on its engine's ``ControlChannel`` (see the module docstring)."""

    def __init__(self, endpoints: list[str], ctx: zmq.Context | None = None) -> None:
        self._channels = [ControlChannel(ep, ctx) for ep in endpoints]
        self._in_workers: dict[int, int] = {}
        """Stream id -> engine of each worker stream submitted, not ended and not cancelled."""

    @property
    def engines(self) -> int:
        return len(self._channels)

    def __len__(self) -> int:
        """Worker streams the workers hold: submitted, not ended and not cancelled."""
        return len(self._in_workers)

    def submit(
        self,
        stream: PcmStream,
        params: SpeechParams,
        text: str,
        *,
        text_open: bool = False,
        traceparent: str = "",
    ) -> None:
        """Start ``stream``'s worker stream (under its current id, on its engine) speaking
        ``text`` (one run of ``params``' text) in ``params``' voice and sampling: the one place
        an ``LlmSubmit`` is made. Raises ``UpstreamUnavailable`` when it could not be queued
        (the workers hold nothing)."""
        engine = stream.engine
        self._channels[engine].send(
            LlmSubmit(
                stream_id=stream.stream_id,
                text=text,
                voice=params.voice,
                sampling=params.sampling,
                text_open=text_open,
                traceparent=traceparent,
            )
        )
        self._in_workers[stream.stream_id] = engine

    def append_text(self, stream: PcmStream, text: str, *, final: bool) -> None:
        """More text for ``stream``'s open worker stream. Raises ``UpstreamUnavailable``."""
        self._channels[stream.engine].append_text(stream.stream_id, text, final=final)

    def stream_left(self, stream: PcmStream, reason: str | None) -> None:
        """``stream`` left the registry's routes (its ``on_leave``): ``reason`` None, its worker
        stream ended (END or ERROR); else why it left before that, and its worker stream, if
        the workers hold it, is cancelled (once: it is forgotten here)."""
        engine = self._in_workers.pop(stream.stream_id, None)
        if engine is not None and reason is not None:
            self._channels[engine].cancel(stream.stream_id, reason)

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self._channels)

    def close(self) -> None:
        for c in self._channels:
            c.close()
