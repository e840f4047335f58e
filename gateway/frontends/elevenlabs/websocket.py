"""ElevenLabs' multi-context text-to-speech WebSocket (the streaming HTTP is ``http``).

What Pipecat's ``ElevenLabsTTSService`` / ``ElevenLabsHttpTTSService`` and LiveKit's
elevenlabs plugin speak, so that they work with only their base URL pointed here.

``GET /v1/text-to-speech/{voice_id}/multi-stream-input`` (WebSocket; ``xi-api-key``
header; query ``output_format``, ``model_id``, ``inactivity_timeout``, ``auto_mode``,
``sync_alignment``, ...: the ones that mean nothing here are accepted and ignored)::

    client: {"text": " ", "context_id": "c1"}                 opens context c1
    client: {"text": "Hello there. ", "context_id": "c1"}      more text (a sentence is
                                                              spoken as soon as it ends)
    client: {"context_id": "c1", "flush": true}               speak what is buffered
    client: {"context_id": "c1", "close_context": true}       end of c1 (see below)
    client: {"text": ""}                                      keepalive
    client: {"close_socket": true}                            stop everything, close
    server: {"audio": "<base64>", "contextId": "c1",
             "alignment": {...}, "normalizedAlignment": {...}}
    server: {"isFinal": true, "contextId": "c1"}

Contexts are independent: each has its own text buffer, its own lane of units (spoken one
after another, ``gateway.frontends.utterance``) and its own encoder, so an MP3 context is one
continuous MP3 stream. Several contexts may speak at once on one socket.

``close_context`` means one of two things, told apart by what came before it:

- after a flush and nothing since (Pipecat and LiveKit end a turn with a flush, then the
  close): the turn is over; the flushed audio is still delivered, then ``isFinal``;
- anything else (text was sent after the last flush, or the context is already closing):
  a barge-in. The unit being spoken is cancelled (``LlmCancel``, the vLLM request is
  aborted), the queued ones are dropped, then ``isFinal``.

A close for an unknown or finished context is ignored; a bad message gets an ``error``
message (with the ``contextId`` when it names one) and breaks nothing else.

``alignment`` is an estimate (``gateway.frontends.alignment``): Orpheus gives no timing;
``alignment`` is over the text sent, ``normalizedAlignment`` over the text spoken (after
the pronunciation dictionaries and normalisation).

``GET /v1/text-to-speech/{voice_id}/stream-input`` is ElevenLabs' single-context socket, the
same machinery with one context (``_SingleSocket``): no ``context_id``, no ``contextId`` in
the answers, and ``{"text": ""}`` ends the input: what is buffered is spoken, then
``{"isFinal": true}`` and the socket closes.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import Sequence
from typing import Any

import msgspec
from aiohttp import WSMsgType, web

from gateway.audio.encoders import AudioEncoder
from gateway.audio.formats import OutputFormat
from gateway.audio.output import make_output
from gateway.cache.control import combined, of_http
from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.alignment import UnitAligners
from gateway.frontends.elevenlabs.messages import (
    API,
    MAX_CONTEXTS,
    AudioMessage,
    ClientMessage,
    ErrorMessage,
    FinalMessage,
    SingleAudioMessage,
    SingleFinalMessage,
    output_format,
    params_for,
)
from gateway.frontends.shared import (
    UNIT_MAX_CHARS,
    Handler,
    api_error,
    send_json_quietly,
)
from gateway.frontends.text_units import Unit, UnitSplitter
from gateway.frontends.utterance import (
    Lane,
    QueueCap,
    pcm_ms,
    receive_unless_idle,
    serve_websocket,
    speak_unit,
)
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.schemas import SpeechParams, check_text
from gateway.service import Gateway
from gateway.streams import StreamFailed
from gateway.text.breaks import BreakError, cap_ms
from shm.messages import UNDECODABLE

log = logging.getLogger(__name__)

_decoder = msgspec.json.Decoder(ClientMessage)
_encoder = msgspec.json.Encoder()
SINGLE_CONTEXT = "default"
"""The one context of the single-context socket (``.../stream-input``)."""


class _Context:
    def __init__(self, cid: str, params: SpeechParams, cap: QueueCap, max_break_ms: int) -> None:
        self.id = cid
        self.splitter = UnitSplitter(
            "sentence",
            UNIT_MAX_CHARS,
            max_break_ms,
            language=params.text_plan.language if params.text_plan else None,
        )
        """Cuts the context's text into units, at break tags too (a tag split across two
        messages is held here until its end arrives: counted in ``_Socket._buffered``)."""
        self.lane = Lane(f"elevenlabs-context-{cid}", cap)
        self.params = params
        """The context's template: the socket's, with its own ``voice_settings.speed``."""
        self.encoder: AudioEncoder | None = None
        self.units: list[ActiveRequest] = []
        """The units whose audio the encoder may hold, not sent yet (the last: the latest);
        the context's tail goes out on their behalf."""
        self.after_flush = False
        """The last message was a flush with no text: a close now ends the turn gracefully."""
        self.closing = False
        self.failed = False
        self.cache_states: list[str | None] = []
        """Each spoken unit's cache state (the final message's ``cache``)."""

    def cache(self) -> str | msgspec.UnsetType:
        """The final message's ``cache``: unset when nothing of the context could be cached."""
        state = combined(self.cache_states)
        return msgspec.UNSET if state is None else state


class _Socket:
    def __init__(
        self, ws: web.WebSocketResponse, link: ClientLink, request: web.Request,
        gateway: Gateway, params: SpeechParams, fmt: OutputFormat,
    ) -> None:  # fmt: skip
        self.ws = ws
        self.link = link
        """Every write to the client (``gateway.link``), the contexts' included."""
        self.key = presented_key(request)
        self.normalization = request.query.get("apply_text_normalization")
        self.cache = of_http(
            request.headers.get("Cache-Control"), request.query.get("enable_logging")
        )
        """What the socket's units let the sentence audio cache do (``enable_logging``)."""
        self.language = gateway.languages.resolve(
            request.query.get("language_code"), request.match_info["voice_id"], "language_code"
        )
        self.request = request
        self.gateway = gateway
        self.params = params
        self.fmt = fmt
        self.contexts: dict[str, _Context] = {}
        g = gateway.config.gateway
        self.cap = QueueCap(g.ws_max_queued_chars, g.ws_max_queued_sentences)
        """Shared by the socket's contexts."""
        self.finished_at = float("-inf")
        """When a context last finished (``time.monotonic()``)."""

    async def send(
        self, msg: msgspec.Struct, n: int = 0, units: Sequence[ActiveRequest] = ()
    ) -> None:
        """One JSON message; when it carries audio, ``n`` bytes of ``units``'."""
        if not self.ws.closed:
            text = _encoder.encode(msg).decode()
            await self.link.write(self.ws.send_str(text), n, units=units)

    async def error(self, err: APIError, cid: str | None = None) -> None:
        await send_json_quietly(
            self.link, self.ws, ErrorMessage(err.code, err.message, err.status, cid)
        )

    def quiet_since(self) -> float | None:
        """None while a context speaks, else when the last one stopped."""
        since = self.finished_at
        for c in self.contexts.values():
            q = c.lane.quiet_since
            if q is None:
                return None
            since = max(since, q)
        return since

    # -- messages ----------------------------------------------------------------------------
    async def handle(self, msg: ClientMessage) -> bool:
        """Apply one client message; False: close the socket."""
        if msg.close_socket:
            return False
        cid = msg.context_id
        if cid is None:
            if msg.text:
                cid = "default"  # ElevenLabs' context when a message names none
            elif msg.flush or msg.close_context:
                await self.error(APIError(400, "missing_context_id", "context_id is required"))
                return True
            else:
                return True  # {"text": ""}: keepalive
        text = msg.text or ""
        try:
            check_text(text, None, param="text", allow_empty=True)
        except APIError as e:
            await self.error(e, cid)
            return True
        ctx = self.contexts.get(cid)
        if msg.close_context:
            if ctx is not None:
                await self.close_context(ctx)
            return True
        if ctx is None:
            if not text:
                return True  # a keepalive or a flush for a finished context: nothing to do
            if len(self.contexts) >= MAX_CONTEXTS:
                await self.error(
                    APIError(
                        429,
                        "max_active_conversations",
                        f"at most {MAX_CONTEXTS} open contexts per socket; close one first",
                    ),
                    cid,
                )
                return True
            params = self.params
            speed = msg.voice_settings.speed if msg.voice_settings else None
            locators = msg.pronunciation_dictionary_locators
            try:
                if speed is not None:
                    params = params_for(
                        self.request, self.gateway, self.fmt, speed=speed,
                        text_plan=params.text_plan,
                    )  # fmt: skip
                if locators:
                    plan = await self.gateway.speech_text.plan(
                        locators, self.normalization, self.key, self.language
                    )
                    params = msgspec.structs.replace(params, text_plan=plan)
            except APIError as e:
                await self.error(e, cid)
                return True
            max_break_ms = cap_ms(self.gateway.config.gateway.max_break_s)
            ctx = self.contexts[cid] = _Context(cid, params, self.cap, max_break_ms)
        if ctx.closing:
            await self.error(
                APIError(400, "context_closed", f"context {cid!r} is closing: no more text"), cid
            )
            return True
        if ctx.failed:
            return True  # its error was sent; the client closes it
        if text and not self.cap.admits(self._buffered(), len(text)):
            await self.error(APIError(429, "input_queue_full", self.cap.refusal()), cid)
            return True
        try:
            units = ctx.splitter.feed(text) if text else []
            if msg.flush:
                units += ctx.splitter.flush()
        except BreakError as e:  # a bad break tag: this message is refused from the tag on
            e.param = "text"
            await self.error(e, cid)
            return True
        for unit in units:
            ctx.lane.push(self._unit_job(ctx, unit), len(unit.text))
        if msg.flush and not text.strip():
            ctx.after_flush = True
        elif text:
            ctx.after_flush = False
        return True

    def _buffered(self) -> int:
        return sum(len(c.splitter.pending) for c in self.contexts.values())

    async def close_context(self, ctx: _Context) -> None:
        if ctx.closing or not ctx.after_flush or ctx.failed:
            await self.cancel_context(ctx)  # a barge-in (or a second close)
            return
        ctx.closing = True
        try:
            units = ctx.splitter.flush()
        except BreakError as e:  # a break tag that never closed
            await self.error(e, ctx.id)
            units = []
        for unit in units:
            ctx.lane.push(self._unit_job(ctx, unit), len(unit.text))

        async def final() -> None:
            if ctx.encoder is not None and not ctx.failed:
                tail = ctx.encoder.finish()
                if tail:  # the last unit's audio, after it ended: written for it
                    msg = AudioMessage(base64.b64encode(tail).decode(), ctx.id)
                    await self.send(msg, len(tail), ctx.units)
            await self._finish(ctx)

        ctx.lane.push(final)

    async def cancel_context(self, ctx: _Context) -> None:
        ctx.closing = True
        await ctx.lane.cancel()
        await self._finish(ctx)

    async def _finish(self, ctx: _Context) -> None:
        if self.contexts.get(ctx.id) is ctx:
            del self.contexts[ctx.id]
            self.finished_at = time.monotonic()
            if ctx.encoder is not None:
                ctx.encoder.close()
            await self.final(ctx)

    async def final(self, ctx: _Context) -> None:
        """Tell the client ``ctx`` is finished."""
        await send_json_quietly(self.link, self.ws, FinalMessage(ctx.id, cache=ctx.cache()))

    async def close_all(self) -> None:
        for ctx in list(self.contexts.values()):
            await ctx.lane.cancel()
            if ctx.encoder is not None:
                ctx.encoder.close()
        self.contexts.clear()

    # -- speaking ----------------------------------------------------------------------------
    def _unit_job(self, ctx: _Context, unit: Unit) -> Any:
        started_at = self.gateway.loop.time()

        async def job() -> None:
            if ctx.failed:
                return
            if ctx.encoder is None:
                ctx.encoder = make_output(ctx.params.output, ctx.params.speed)
            enc = ctx.encoder
            params = msgspec.structs.replace(ctx.params, text=unit.text).spoken()
            aligners = UnitAligners(unit.raw, params.text, unit.pause_ms)
            counted = False

            async def deliver(
                active: ActiveRequest | None, chunks: list[bytes], last: bool
            ) -> None:
                nonlocal counted
                if active is not None and (not ctx.units or ctx.units[-1] is not active):
                    ctx.units.append(active)
                if active is not None and not counted:
                    counted = True
                    ctx.cache_states.append(active.cache_state)
                n = sum(map(len, chunks))
                data = b"".join(map(enc.encode, chunks))
                times, normalized = aligners.take(pcm_ms(n), last=last)
                if not data and times is None and normalized is None:
                    return
                audio = base64.b64encode(data).decode() if data else None
                msg = AudioMessage(audio, ctx.id, times, normalized)
                await self.send(msg, len(data), ctx.units)
                if data and ctx.units:
                    del ctx.units[:-1]  # the others have their first audio

            try:
                await speak_unit(
                    self.gateway, params, params.text, self.link, deliver,
                    started_at=started_at, pause_ms=unit.pause_ms, cache=self.cache,
                )  # fmt: skip
            except (APIError, StreamFailed) as e:
                ctx.failed = True
                await self.error(api_error(e), ctx.id)

        return job


class _SingleSocket(_Socket):
    """ElevenLabs' single-context socket (``.../stream-input``): one context, ``default``;
    messages without ``contextId``; ``{"text": ""}`` ends the input (what is buffered is
    spoken, then ``{"isFinal": true}`` and the socket closes)."""

    async def send(
        self, msg: msgspec.Struct, n: int = 0, units: Sequence[ActiveRequest] = ()
    ) -> None:
        if isinstance(msg, AudioMessage):
            msg = SingleAudioMessage(msg.audio, msg.alignment, msg.normalizedAlignment)
        await super().send(msg, n, units)

    async def error(self, err: APIError, cid: str | None = None) -> None:
        await send_json_quietly(self.link, self.ws, ErrorMessage(err.code, err.message, err.status))

    async def final(self, ctx: _Context) -> None:
        await send_json_quietly(self.link, self.ws, SingleFinalMessage(cache=ctx.cache()))
        if not self.ws.closed:
            await self.link.write(self.ws.close())

    async def handle(self, msg: ClientMessage) -> bool:
        if msg.close_socket:
            return False
        ended = msg.text == "" and not msg.flush
        if ended and SINGLE_CONTEXT not in self.contexts:
            return False  # nothing was said: nothing to finish
        msg = msgspec.structs.replace(msg, context_id=SINGLE_CONTEXT, close_context=False)
        if not ended:
            return await super().handle(msg)
        ctx = self.contexts[SINGLE_CONTEXT]
        await super().handle(msgspec.structs.replace(msg, text=None, flush=True))
        await self.close_context(ctx)  # after a flush: the turn ends, its audio delivered
        return True


async def _serve_ws(
    ws: web.WebSocketResponse, link: ClientLink, request: web.Request, gateway: Gateway,
    params: SpeechParams, fmt: OutputFormat, inactivity_s: float, single: bool = False,
) -> None:  # fmt: skip
    cls = _SingleSocket if single else _Socket
    sock = cls(ws, link, request, gateway, params, fmt)
    try:
        while True:
            try:
                msg = await receive_unless_idle(ws, inactivity_s, sock.quiet_since)
            except TimeoutError:
                await sock.error(
                    APIError(
                        408, "input_timeout_exceeded", f"no text received for {inactivity_s:g} s"
                    )
                )
                break
            if msg.type == WSMsgType.BINARY:
                await sock.error(APIError(400, "invalid_message", "send JSON text messages"))
                continue
            if msg.type != WSMsgType.TEXT:
                return  # the client went away: finally cancels everything in flight
            try:
                message = _decoder.decode(msg.data)
            except UNDECODABLE as e:
                await sock.error(APIError(400, "invalid_message", f"invalid message: {e}"))
                continue
            if not await sock.handle(message):
                break
    finally:
        await sock.close_all()
    if not ws.closed:
        await link.write(ws.close())


def _inactivity(request: web.Request) -> float:
    try:
        return min(180.0, max(1.0, float(request.query.get("inactivity_timeout", "20"))))
    except ValueError:
        raise APIError(400, "invalid_request", "inactivity_timeout must be a number") from None


def multi_stream_handler(gateway: Gateway, *, single: bool = False) -> Handler:
    """The multi-context socket, or with ``single`` the single-context one."""

    async def multi_stream_input(request: web.Request) -> web.StreamResponse:
        fmt = output_format(request)  # refused with an HTTP error before the upgrade
        language = gateway.languages.resolve(
            request.query.get("language_code"), request.match_info["voice_id"], "language_code"
        )
        plan = await gateway.speech_text.plan(
            None, request.query.get("apply_text_normalization"), presented_key(request), language
        )
        params = params_for(request, gateway, fmt, text_plan=plan)
        inactivity_s = _inactivity(request)
        return await serve_websocket(
            request,
            gateway,
            API,
            lambda ws, link: _serve_ws(
                ws, link, request, gateway, params, fmt, inactivity_s, single
            ),
        )

    return multi_stream_input
