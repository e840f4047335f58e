"""ElevenLabs' text-to-speech APIs: the multi-context WebSocket and the streaming HTTP.

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
after another, ``gateway.utterance``) and its own encoder, so an MP3 context is one
continuous MP3 stream. Several contexts may speak at once on one socket.

``close_context`` means one of two things, told apart by what came before it:

- after a flush and nothing since (Pipecat and LiveKit end a turn with a flush, then the
  close): the turn is over; the flushed audio is still delivered, then ``isFinal``;
- anything else (text was sent after the last flush, or the context is already closing):
  a barge-in. The unit being spoken is cancelled (``LlmCancel``, the vLLM request is
  aborted), the queued ones are dropped, then ``isFinal``.

A close for an unknown or finished context is ignored; a bad message gets an ``error``
message (with the ``contextId`` when it names one) and breaks nothing else.

``alignment`` is an estimate (``gateway.alignment``): Orpheus gives no timing.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from typing import Any

import msgspec
from aiohttp import WSMsgType, web

from gateway.alignment import CharTimes, ChunkAligner
from gateway.audio_out import ELEVENLABS_FORMATS, OutputFormat, make_output
from gateway.encoders import AudioEncoder
from gateway.errors import APIError
from gateway.schemas import SpeechParams, build_params, check_text
from gateway.service import Gateway
from gateway.speech_http import Handler, read_body
from gateway.streams import StreamFailed
from gateway.text_units import Unit, UnitSplitter
from gateway.utterance import (
    Lane,
    QueueCap,
    pcm_ms,
    receive_unless_idle,
    serve_websocket,
    speak_unit,
)
from shm.messages import SamplingOverrides

log = logging.getLogger(__name__)

API = "elevenlabs"
WS_PATH = "/v1/text-to-speech/{voice_id}/multi-stream-input"
STREAM_PATH = "/v1/text-to-speech/{voice_id}/stream"
TIMESTAMPS_PATH = "/v1/text-to-speech/{voice_id}/stream/with-timestamps"
DEFAULT_FORMAT = "mp3_44100_128"
MAX_CONTEXTS = 16
"""Open contexts per socket (ElevenLabs allows 5; clients that leave contexts open while
they start new ones are common, so this is more generous)."""
UNIT_MAX_CHARS = 280


def output_format(request: web.Request) -> OutputFormat:
    name = request.query.get("output_format", DEFAULT_FORMAT)
    fmt = ELEVENLABS_FORMATS.get(name)
    if fmt is None:
        raise APIError(
            400,
            "invalid_output_format",
            f"output_format {name!r} is not supported; use one of {', '.join(ELEVENLABS_FORMATS)}",
            param="output_format",
        )
    return fmt


def params_for(
    request: web.Request,
    gateway: Gateway,
    fmt: OutputFormat,
    *,
    text: str = "",
    max_chars: int | None = None,
    speed: float | None = None,
    seed: int | None = None,
) -> SpeechParams:
    """The request's ``SpeechParams`` (``build_params``): the path's voice, the format named
    by ``output_format``; with no text, the template of a socket or a context."""
    return build_params(
        gateway.voices,
        gateway.limits,
        text=text,
        voice=request.match_info["voice_id"],
        max_chars=max_chars,
        text_param="text",
        allow_empty=max_chars is None,
        response_format=fmt.codec,
        sample_rate=fmt.sample_rate,
        bitrate=fmt.bitrate,
        speed=speed,
        sampling=SamplingOverrides(seed=seed),
    )


class VoiceSettings(msgspec.Struct):
    speed: float | None = None


class ClientMessage(msgspec.Struct, kw_only=True):
    """One WebSocket message; fields this server has no use for are ignored."""

    text: str | None = None
    context_id: str | None = None
    flush: bool = False
    close_context: bool = False
    close_socket: bool = False
    voice_settings: VoiceSettings | None = None


class AudioMessage(msgspec.Struct, omit_defaults=True):
    audio: str | None
    contextId: str
    alignment: CharTimes | None = None
    normalizedAlignment: CharTimes | None = None


class FinalMessage(msgspec.Struct):
    contextId: str
    isFinal: bool = True


class ErrorMessage(msgspec.Struct, omit_defaults=True):
    error: str
    message: str
    code: int
    contextId: str | None = None


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ClientMessage)


class _Context:
    def __init__(self, cid: str, params: SpeechParams, cap: QueueCap) -> None:
        self.id = cid
        self.splitter = UnitSplitter("sentence", UNIT_MAX_CHARS)
        self.lane = Lane(f"elevenlabs-context-{cid}", cap)
        self.params = params
        """The context's template: the socket's, with its own ``voice_settings.speed``."""
        self.encoder: AudioEncoder | None = None
        self.after_flush = False
        """The last message was a flush with no text: a close now ends the turn gracefully."""
        self.closing = False
        self.failed = False


class _Socket:
    def __init__(
        self, ws: web.WebSocketResponse, request: web.Request, gateway: Gateway,
        params: SpeechParams, fmt: OutputFormat, on_abort: Any,
    ) -> None:  # fmt: skip
        self.ws = ws
        self.request = request
        self.gateway = gateway
        self.params = params
        self.fmt = fmt
        self.on_abort = on_abort
        self.contexts: dict[str, _Context] = {}
        g = gateway.config.gateway
        self.cap = QueueCap(g.ws_max_queued_chars, g.ws_max_queued_sentences)
        """Shared by the socket's contexts."""
        self.finished_at = float("-inf")
        """When a context last finished (``time.monotonic()``)."""

    async def send(self, msg: msgspec.Struct) -> None:
        if not self.ws.closed:
            await self.ws.send_str(_encoder.encode(msg).decode())

    async def error(self, err: APIError, cid: str | None = None) -> None:
        with contextlib.suppress(ConnectionError):
            await self.send(ErrorMessage(err.code, err.message, err.status, cid))

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
            if speed is not None:
                try:
                    params = params_for(self.request, self.gateway, self.fmt, speed=speed)
                except APIError as e:
                    await self.error(e, cid)
                    return True
            ctx = self.contexts[cid] = _Context(cid, params, self.cap)
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
        units = ctx.splitter.feed(text) if text else []
        if msg.flush:
            units += ctx.splitter.flush()
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
        for unit in ctx.splitter.flush():
            ctx.lane.push(self._unit_job(ctx, unit), len(unit.text))

        async def final() -> None:
            if ctx.encoder is not None and not ctx.failed:
                tail = ctx.encoder.finish()
                if tail:
                    await self.send(AudioMessage(base64.b64encode(tail).decode(), ctx.id))
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
            with contextlib.suppress(ConnectionError):
                await self.send(FinalMessage(ctx.id))

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
            aligner = ChunkAligner(unit.raw)

            async def deliver(chunks: list[bytes], last: bool) -> int:
                n = sum(map(len, chunks))
                data = b"".join(map(enc.encode, chunks))
                times = aligner.take(pcm_ms(n), last=last)
                if not data and times is None:
                    return 0
                audio = base64.b64encode(data).decode() if data else None
                await self.send(AudioMessage(audio, ctx.id, times, times))
                return len(data)

            try:
                await speak_unit(
                    self.gateway, ctx.params, unit.text, API, deliver,
                    started_at=started_at, on_abort=self.on_abort,
                )  # fmt: skip
            except (APIError, StreamFailed) as e:
                err = e if isinstance(e, APIError) else APIError.from_stream_error(e.error)
                ctx.failed = True
                await self.error(err, ctx.id)

        return job


async def _serve_ws(
    ws: web.WebSocketResponse, request: web.Request, gateway: Gateway, params: SpeechParams,
    fmt: OutputFormat, inactivity_s: float,
) -> None:  # fmt: skip
    transport = request.transport
    on_abort = transport.abort if transport is not None else None
    sock = _Socket(ws, request, gateway, params, fmt, on_abort)
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
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                await sock.error(APIError(400, "invalid_message", f"invalid message: {e}"))
                continue
            if not await sock.handle(message):
                break
    finally:
        await sock.close_all()
    if not ws.closed:
        await ws.close()


def _inactivity(request: web.Request) -> float:
    try:
        return min(180.0, max(1.0, float(request.query.get("inactivity_timeout", "20"))))
    except ValueError:
        raise APIError(400, "invalid_request", "inactivity_timeout must be a number") from None


def multi_stream_handler(gateway: Gateway) -> Handler:
    async def multi_stream_input(request: web.Request) -> web.StreamResponse:
        fmt = output_format(request)  # refused with an HTTP error before the upgrade
        params = params_for(request, gateway, fmt)
        inactivity_s = _inactivity(request)
        return await serve_websocket(
            request,
            gateway,
            lambda ws: _serve_ws(ws, request, gateway, params, fmt, inactivity_s),
        )

    return multi_stream_input


# -- HTTP ------------------------------------------------------------------------------------
class SpeechBody(msgspec.Struct, kw_only=True):
    """Body of ``POST /v1/text-to-speech/{voice_id}/stream``; other fields are ignored."""

    text: str
    model_id: str | None = None
    seed: int | None = None
    voice_settings: VoiceSettings | None = None


class HttpAlignment(msgspec.Struct):
    characters: list[str]
    character_start_times_seconds: list[float]
    character_end_times_seconds: list[float]


class TimestampChunk(msgspec.Struct, omit_defaults=True):
    audio_base64: str | None = None
    alignment: HttpAlignment | None = None
    normalized_alignment: HttpAlignment | None = None


def stream_handler(gateway: Gateway, *, timestamps: bool) -> Handler:
    """``POST .../stream`` (audio bytes) and ``.../stream/with-timestamps`` (JSON lines)."""
    g = gateway.config.gateway
    decoder = msgspec.json.Decoder(SpeechBody)

    async def tts_stream(request: web.Request) -> web.StreamResponse:
        started_at = gateway.loop.time()
        fmt = output_format(request)
        body = await read_body(request, g.max_body_bytes)
        try:
            req = decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise APIError(400, "invalid_request", f"invalid body: {e}") from None
        params = params_for(
            request, gateway, fmt, text=req.text, max_chars=g.max_input_chars,
            speed=req.voice_settings.speed if req.voice_settings else None, seed=req.seed,
        )  # fmt: skip
        splitter = UnitSplitter("sentence", UNIT_MAX_CHARS)
        units = splitter.feed(params.text) + splitter.flush()
        enc = make_output(params.output, params.speed)
        resp: web.StreamResponse | None = None
        audio_ms = 0.0
        span_start = 0.0

        async def write(data: bytes) -> None:
            nonlocal resp
            if resp is None:
                resp = web.StreamResponse(
                    status=200,
                    headers={
                        "Content-Type": "application/json" if timestamps else fmt.content_type,
                        "Cache-Control": "no-cache",
                    },
                )
                await resp.prepare(request)
            await resp.write(data)

        def line(data: bytes, times: Any) -> bytes:
            al = None
            if times is not None:
                starts = [round((span_start + s) / 1000, 4) for s in times.charStartTimesMs]
                ends = [
                    round((span_start + s + d) / 1000, 4)
                    for s, d in zip(times.charStartTimesMs, times.charDurationsMs, strict=True)
                ]
                al = HttpAlignment(times.chars, starts, ends)
            chunk = TimestampChunk(base64.b64encode(data).decode() if data else None, al, al)
            return _encoder.encode(chunk) + b"\n"

        try:
            for unit in units:
                aligner = ChunkAligner(unit.raw)

                async def deliver(
                    chunks: list[bytes], last: bool, al: ChunkAligner = aligner
                ) -> int:
                    nonlocal audio_ms, span_start
                    n = sum(map(len, chunks))
                    data = b"".join(map(enc.encode, chunks))
                    audio_ms += pcm_ms(n)
                    if not timestamps:
                        if data:
                            await write(data)
                        return len(data)
                    times = al.take(pcm_ms(n), last=last)
                    if data or times is not None:
                        await write(line(data, times))
                        if times is not None:
                            span_start = audio_ms
                    return len(data)

                # TTFB of the first unit counts from the request; of the others, from the
                # moment they could start (the end of the one before).
                await speak_unit(
                    gateway, params, unit.text, API, deliver,
                    started_at=started_at if unit is units[0] else None,
                    on_abort=request.transport.abort if request.transport is not None else None,
                )  # fmt: skip
            tail = enc.finish()
            if tail:
                await write(line(tail, None) if timestamps else tail)
            if resp is None:
                await write(b"")
            assert resp is not None
            await resp.write_eof()
            return resp
        except (APIError, StreamFailed) as e:
            if resp is None:
                raise (
                    e if isinstance(e, APIError) else APIError.from_stream_error(e.error)
                ) from None
            if request.transport is not None:
                request.transport.abort()  # never let a cut stream pass for a whole one
            return resp
        finally:
            enc.close()

    return tts_stream
