"""The gateway's control channels to the llm workers: a ZeroMQ PUSH of msgpack Structs per
vLLM engine (``llm.engines``), each to its worker's ``control-<engine>`` socket.

Every message names the engine its stream was placed on at admission
(``gateway.admission``): a stream's submit, appends and cancel all reach the same engine.

Sends never block the event loop: a message that cannot be queued (the llm_worker is not
draining its socket and the high-water mark is reached) is reported to the caller, which
fails the request explicitly instead of waiting.
"""

from __future__ import annotations

import logging

import zmq

from shm.messages import (
    LlmAppendText,
    LlmCancel,
    LlmControl,
    LlmSubmit,
    SamplingOverrides,
    control_encoder,
)

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

    def submit(
        self,
        stream_id: int,
        text: str,
        voice: str,
        sampling: SamplingOverrides,
        *,
        text_open: bool = False,
        traceparent: str = "",
    ) -> None:
        self._send(
            LlmSubmit(
                stream_id=stream_id,
                text=text,
                voice=voice,
                sampling=sampling,
                text_open=text_open,
                traceparent=traceparent,
            )
        )

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
    """One ``ControlChannel`` per engine; ``engine(e)`` is engine ``e``'s."""

    def __init__(self, endpoints: list[str], ctx: zmq.Context | None = None) -> None:
        self.channels = [ControlChannel(ep, ctx) for ep in endpoints]

    def engine(self, index: int) -> ControlChannel:
        return self.channels[index]

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.channels)

    def close(self) -> None:
        for c in self.channels:
            c.close()
