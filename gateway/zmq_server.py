"""The gateway's ZeroMQ front end: a ROUTER serving ``gateway.zmq_protocol`` messages.

Each ``Speak`` runs as its own task through the same admission, streams and encoders as
HTTP. Sends never block the event loop: the ROUTER is ``ROUTER_MANDATORY``, so a client
that went away is reported (EHOSTUNREACH, its stream is cancelled) and a client that does
not read fills its pipe (EAGAIN) and is retried, then dropped by the stall watchdog.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging

import msgspec
import zmq
import zmq.asyncio

from common.zmq_recv import incoming_multipart
from gateway.audio_out import make_output
from gateway.auth import ZMQ_KEY_HINT, ApiKeys
from gateway.encoders import AudioEncoder
from gateway.errors import APIError
from gateway.schemas import SpeechParams, build_params
from gateway.service import Gateway
from gateway.session import Session
from gateway.streams import StreamFailed
from gateway.zmq_protocol import (
    AppendText,
    Audio,
    Cancel,
    Done,
    Error,
    ServerMessage,
    Speak,
    Started,
    client_decoder,
    encoder,
)
from shm.records import StreamError

log = logging.getLogger(__name__)

SNDHWM = 10_000
RETRY_SEND_S = 0.005
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 15_000
CLIENT_CANCELLED = "cancelled"
MAX_PENDING_APPENDS = 256


def _request_id_of(payload: bytes) -> int | None:
    """The request_id of a message that failed validation, so the client learns which."""
    try:
        obj = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    rid = obj.get("request_id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, int) and not isinstance(rid, bool) else None


class _PeerGone(Exception):
    pass


class _Request:
    __slots__ = ("pending", "session", "task")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.session: Session | None = None
        self.pending: list[AppendText] = []
        """Text that arrived while the request waited for admission."""


class ZmqFrontend:
    def __init__(self, gateway: Gateway, endpoint: str) -> None:
        self._gateway = gateway
        self.endpoint = endpoint
        self._sock: zmq.asyncio.Socket | None = None
        self._requests: dict[tuple[bytes, int], _Request] = {}
        self._keys = ApiKeys(gateway.config.gateway.api_keys)

    async def run(self) -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.bind(self.endpoint)
        self._sock = sock
        log.info("ZeroMQ clients on %s", self.endpoint)
        try:
            async for frames in incoming_multipart(sock):
                try:
                    await self._handle(frames)
                except Exception:  # one bad message must not stop the front end
                    log.exception("error handling a ZeroMQ client message")
        finally:
            for req in list(self._requests.values()):
                if req.task is not None:
                    req.task.cancel()
            sock.close(linger=0)
            self._sock = None

    async def _reply(self, identity: bytes, msg: ServerMessage) -> None:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([identity, encoder.encode(msg)], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # a control reply to a client that does not read: it loses only this message
        except zmq.ZMQError as e:
            if e.errno != errno.EHOSTUNREACH:
                raise

    async def _handle(self, frames: list[bytes]) -> None:
        if len(frames) != 2:  # the identity and one message frame
            if frames:
                await self._reply(
                    frames[0],
                    Error(None, 400, "invalid_message", "send exactly one frame per message"),
                )
            return
        identity, payload = frames
        try:
            msg = client_decoder.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            rid = _request_id_of(payload)
            open_req = self._requests.get((identity, rid)) if rid is not None else None
            if open_req is not None:  # a bad message about an open request ends that request
                self._fail(open_req, StreamError("invalid_message", str(e), 400))
            else:
                await self._reply(identity, Error(rid, 400, "invalid_message", str(e)))
            return
        key = (identity, msg.request_id)
        req = self._requests.get(key)
        if isinstance(msg, Speak):
            if req is not None:
                await self._reply(
                    identity,
                    Error(msg.request_id, 400, "duplicate_request_id", "request_id is in use"),
                )
                return
            req = _Request()
            self._requests[key] = req
            req.task = asyncio.create_task(self._serve(identity, msg, req))
            return
        if req is None:
            await self._reply(
                identity, Error(msg.request_id, 400, "unknown_request", "no such open request")
            )
        elif isinstance(msg, AppendText):
            if req.session is None:
                if len(req.pending) >= MAX_PENDING_APPENDS:
                    self._fail(req, StreamError("too_many_messages", "too much queued text", 400))
                else:
                    req.pending.append(msg)
            else:
                self._append(req, msg)
        elif isinstance(msg, Cancel):
            if req.session is None:
                if req.task is not None:
                    req.task.cancel()
            else:
                self._fail(req, StreamError(CLIENT_CANCELLED, "cancelled by the client", 499))

    def _fail(self, req: _Request, error: StreamError) -> None:
        if req.session is None:
            if req.task is not None:
                req.task.cancel()
            return
        self._gateway.registry.fail(
            req.session.stream, error, cancel_upstream=True, discard_pending=True
        )

    def _append(self, req: _Request, msg: AppendText) -> None:
        assert req.session is not None
        try:
            req.session.append_text(msg.text, final=msg.final)
        except APIError as e:
            self._fail(req, StreamError(e.code, e.message, e.status))

    def _params(self, msg: Speak) -> SpeechParams:
        self._keys.check(msg.api_key, ZMQ_KEY_HINT)
        return build_params(
            self._gateway.voices,
            self._gateway.limits,
            text=msg.input,
            voice=msg.voice or None,
            max_chars=self._gateway.config.gateway.max_input_chars,
            allow_empty=msg.text_open,
            response_format=msg.response_format,
            sample_rate=msg.sample_rate,
            speed=msg.speed,
            sampling=msg.overrides(),
            text_open=msg.text_open,
        )

    async def _send_audio(self, identity: bytes, msg: Audio, session: Session) -> None:
        assert self._sock is not None
        frames = [identity, encoder.encode(msg)]
        loop = self._gateway.loop
        while True:
            try:
                await self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                session.write_started = 0.0
                return
            except zmq.Again:  # the client's pipe is full: wait (the watchdog bounds this)
                if not session.write_started:
                    session.write_started = loop.time()
                await asyncio.sleep(RETRY_SEND_S)
            except zmq.ZMQError as e:
                if e.errno == errno.EHOSTUNREACH:
                    raise _PeerGone from None
                raise

    async def _serve(self, identity: bytes, msg: Speak, req: _Request) -> None:
        rid = msg.request_id
        encoder: AudioEncoder | None = None
        try:
            params = self._params(msg)
            encoder = make_output(params.output, params.speed)
            async with self._gateway.open_session(
                params, "zmq", text_open=msg.text_open
            ) as session:
                req.session = session
                if req.task is not None:
                    session.stream.on_abort = req.task.cancel
                for pending in req.pending:
                    self._append(req, pending)
                req.pending.clear()
                started = Started(
                    rid, session.stream.stream_id, params.output.sample_rate, params.response_format
                )
                await self._reply(identity, started)
                try:
                    await self._stream_audio(identity, rid, session, encoder)
                except StreamFailed as e:
                    if e.error.code == CLIENT_CANCELLED:
                        seconds = round(session.audio_seconds, 4)
                        await self._reply(identity, Done(rid, "cancelled", seconds, 0))
                    else:
                        err = APIError.from_stream_error(e.error)
                        await self._reply(identity, Error(rid, err.status, err.code, err.message))
        except APIError as e:
            await self._reply(identity, Error(rid, e.status, e.code, e.message))
        except _PeerGone:
            pass  # leaving the session cancelled the stream upstream
        finally:
            if encoder is not None:
                encoder.close()
            self._requests.pop((identity, rid), None)

    async def _stream_audio(
        self, identity: bytes, rid: int, session: Session, encoder: AudioEncoder
    ) -> None:
        """Audio messages in order, then Done; raises StreamFailed if the stream fails."""
        stream = session.stream
        seq = 0
        while chunks := await stream.next_chunks():
            for chunk in chunks:
                data = encoder.encode(chunk)
                if data:
                    await self._send_audio(identity, Audio(rid, seq, data), session)
                    seq += 1
                    session.sent(len(data))
        tail = encoder.finish()
        if tail:
            await self._send_audio(identity, Audio(rid, seq, tail), session)
            session.sent(len(tail))
        end = stream.end
        done = Done(
            rid,
            end.reason if end else "stop",
            round(session.audio_seconds, 4),
            end.frames if end else 0,
        )
        await self._reply(identity, done)
        session.completed = True

    async def close(self) -> None:
        tasks = [r.task for r in self._requests.values() if r.task is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
