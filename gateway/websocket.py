"""WebSocket ``/v1/audio/speech/stream``: text in as it is written, PCM out as it is made.

Protocol (JSON text frames from the client, binary PCM and JSON text frames back; the
full description is in docs/api.md):

    client: {"type": "start", "voice": "tara", "input": "Hello", "final": false, ...}
    server: {"type": "started", "stream_id": ..., "sample_rate": 24000, ...}
    client: {"type": "text", "text": " world."}   ... more text ...
    client: {"type": "end"}                        (or "final": true on the last text)
    server: <binary int16 LE mono 24 kHz> ... in order
    server: {"type": "done", "reason": "stop", ...}, then close 1000

Errors: {"type": "error", "error": {...}} then close with 4000 + the HTTP status the same
error would have over HTTP (4400 bad message, 4408 timeout / slow client, 4429 busy,
4503 draining or worker restarted, ...). {"type": "cancel"} ends the stream (close 1000).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from aiohttp import WSMsgType, web

from gateway.errors import APIError, ErrorDetail
from gateway.schemas import ModelName, SamplingFields, SpeechParams, VoiceRef, check_text
from gateway.service import Gateway, Session
from gateway.speech_http import Handler
from gateway.streams import StreamFailed
from shm.records import SAMPLE_RATE, StreamError

log = logging.getLogger(__name__)

WS_PATH = "/v1/audio/speech/stream"
HEARTBEAT_S = 30.0
CLIENT_CANCELLED = "cancelled"
CLIENT_GONE = "client_disconnected"


# -- client messages -----------------------------------------------------------------------
class WsStart(
    SamplingFields,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag="start",
    tag_field="type",
):
    voice: str | VoiceRef | None = None
    """Model voice or OpenAI alias; None: the model's default voice."""
    input: str = ""
    """Text known at the start (may be empty when ``final`` is false)."""
    final: bool = False
    """True: ``input`` is the whole text (no ``text`` messages follow)."""
    model: ModelName | None = None


class WsText(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="text", tag_field="type"):
    text: str
    final: bool = False


class WsEnd(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="end", tag_field="type"):
    pass


class WsCancel(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="cancel", tag_field="type"
):
    pass


ClientMessage = WsStart | WsText | WsEnd | WsCancel


# -- server messages -----------------------------------------------------------------------
class WsStarted(msgspec.Struct, frozen=True, tag="started", tag_field="type"):
    stream_id: int
    sample_rate: int = SAMPLE_RATE
    channels: int = 1
    format: str = "pcm_s16le"


class WsDone(msgspec.Struct, frozen=True, tag="done", tag_field="type"):
    reason: str
    audio_seconds: float
    frames: int


class WsError(msgspec.Struct, frozen=True, tag="error", tag_field="type"):
    error: ErrorDetail


_decoder = msgspec.json.Decoder(ClientMessage)
_encoder = msgspec.json.Encoder()


def close_code(err: APIError) -> int:
    return 4000 + err.status if 400 <= err.status <= 599 else 4500


async def _receive(ws: web.WebSocketResponse, timeout_s: float | None) -> ClientMessage | None:
    """The next client message; None once the client closed; APIError for a bad one."""
    try:
        msg = await ws.receive(timeout_s)
    except TimeoutError:
        raise APIError(408, "timeout", f"no message from the client for {timeout_s:g} s") from None
    if msg.type == WSMsgType.TEXT:
        try:
            return _decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as e:
            raise APIError(400, "invalid_message", f"invalid message: {e}") from None
    if msg.type == WSMsgType.BINARY:
        raise APIError(400, "invalid_message", "binary messages are not accepted; send JSON text")
    return None  # CLOSE, CLOSING, CLOSED, ERROR (e.g. a frame over the size limit)


async def _close_with_error(ws: web.WebSocketResponse, err: APIError) -> None:
    if ws.closed:
        return
    with contextlib.suppress(ConnectionError):
        await ws.send_str(_encoder.encode(WsError(err.body().error)).decode())
        await ws.close(code=close_code(err), message=err.code.encode()[:120])


async def _read_client(ws: web.WebSocketResponse, session: Session, gateway: Gateway) -> None:
    """Forward the client's text; a bad message, cancel or close ends the stream."""
    stream = session.stream
    g = gateway.config.gateway
    error: StreamError | None = None
    try:
        while not stream.done:
            timeout = None if stream.text_closed else g.ws_text_idle_timeout_s
            msg = await _receive(ws, timeout)
            if msg is None:
                error = StreamError(CLIENT_GONE, "the client closed the connection", 499)
            elif isinstance(msg, WsText):
                session.append_text(msg.text, final=msg.final)
            elif isinstance(msg, WsEnd):
                session.append_text("", final=True)
            elif isinstance(msg, WsCancel):
                error = StreamError(CLIENT_CANCELLED, "cancelled by the client", 499)
            else:
                raise APIError(400, "invalid_message", "`start` may only be sent once")
            if error is not None:
                break
    except APIError as e:
        error = StreamError(e.code, e.message, e.status)
    if error is not None:
        gateway.registry.fail(stream, error, cancel_upstream=True, discard_pending=True)


async def _serve(ws: web.WebSocketResponse, request: web.Request, gateway: Gateway) -> None:
    g = gateway.config.gateway
    first = await _receive(ws, g.ws_start_timeout_s)
    if first is None:
        return
    if not isinstance(first, WsStart):
        raise APIError(400, "invalid_message", 'the first message must be {"type": "start", ...}')
    started_at = gateway.loop.time()
    voice = first.voice.id if isinstance(first.voice, VoiceRef) else first.voice
    params = SpeechParams(
        text=check_text(first.input, g.max_input_chars, allow_empty=not first.final),
        voice=gateway.voices.resolve(voice or gateway.voices.default),
        sampling=first.overrides(),
        response_format="pcm",
    )
    loop = asyncio.get_running_loop()
    async with gateway.open_session(
        params, "ws", text_open=not first.final, started_at=started_at
    ) as session:
        stream = session.stream
        transport = request.transport
        if transport is not None:
            stream.on_abort = transport.abort
        await ws.send_str(_encoder.encode(WsStarted(stream.stream_id)).decode())
        reader = asyncio.create_task(_read_client(ws, session, gateway))
        try:
            while chunks := await stream.next_chunks():
                for chunk in chunks:
                    session.write_started = loop.time()
                    await ws.send_bytes(chunk)
                    session.write_started = 0.0
                    session.sent(len(chunk))
            end = stream.end
            done = WsDone(
                reason=end.reason if end else "stop",
                audio_seconds=round(session.audio_seconds, 4),
                frames=end.frames if end else 0,
            )
            await ws.send_str(_encoder.encode(done).decode())
            session.completed = True
            await ws.close(code=1000, message=b"done")
        except StreamFailed as e:
            if e.error.code == CLIENT_CANCELLED:
                await ws.close(code=1000, message=b"cancelled")
            elif e.error.code != CLIENT_GONE:
                await _close_with_error(ws, APIError.from_stream_error(e.error))
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


def websocket_handler(gateway: Gateway) -> Handler:
    g = gateway.config.gateway

    async def speech_stream(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=g.max_body_bytes, heartbeat=HEARTBEAT_S)
        await ws.prepare(request)
        try:
            await _serve(ws, request, gateway)
        except APIError as e:
            await _close_with_error(ws, e)
        except ConnectionError:
            pass  # the client went away: leaving the session cancelled the stream upstream
        if not ws.closed:
            await ws.close()
        return ws

    return speech_stream
