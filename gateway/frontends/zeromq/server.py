"""The gateway's ZeroMQ front end: a ROUTER serving ``orpheus_wire.zeromq`` messages.

Each ``Speak`` runs as its own task through the same admission, streams and encoders as
HTTP. Sends never block the event loop: the ROUTER is ``ROUTER_MANDATORY``, so a client
that went away is reported (EHOSTUNREACH, its stream is cancelled) and a client that does
not read fills its pipe (EAGAIN) and is retried, then dropped by the stall watchdog.

Every ``Speak`` ends with exactly one ``Done`` or ``Error`` (none after the client's own
``Cancel`` while it waits for admission); ``_Request.ended`` makes the first one the only
one, whoever sends it (the request's task, or the reader that refuses a message about a
request still in the queue). A message that cannot be decoded is answered with an ``Error``
whose ``request_id`` is null, or ends the open request it names. Frames larger than
``gateway.zmq_max_message_bytes`` never reach the gateway (``ZMQ_MAXMSGSIZE``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging

import msgspec
import zmq
import zmq.asyncio

from common.zmq_recv import incoming_multipart
from gateway.apis import Api
from gateway.audio.encoders import AudioEncoder
from gateway.audio.output import make_output
from gateway.cache.control import of_field
from gateway.disclosure.headers import watermark_of
from gateway.edge.auth import ZMQ_KEY_HINT, ApiKeys
from gateway.errors import APIError
from gateway.link import ClientLink
from gateway.requests import ActiveRequest, open_text_too_long
from gateway.schemas import SpeechParams, build_params, check_text, sampling_overrides
from gateway.service import Gateway
from gateway.streams import StreamFailed
from gateway.text.breaks import BreakScanner, Pause, Piece, cap_ms, join_breaks
from gateway.text.plan import HeldText
from orpheus_wire.zeromq import (
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
from shm.messages import UNDECODABLE
from shm.records import StreamError

log = logging.getLogger(__name__)

SNDHWM = 10_000
RETRY_SEND_S = 0.005
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 15_000
CLIENT_CANCELLED = "cancelled"
MAX_PENDING_APPENDS = 256


class _Addressed(msgspec.Struct):
    """Any map with an integer ``request_id`` (other fields are skipped)."""

    request_id: int


_addressed = msgspec.msgpack.Decoder(_Addressed)


def _request_id_of(payload: bytes) -> int | None:
    """The request_id of a message that failed validation, so the client learns which."""
    try:
        return _addressed.decode(payload).request_id
    except (*UNDECODABLE, RecursionError):
        return None  # RecursionError: deeply nested arrays or maps that msgspec skips over


def _why(e: Exception) -> str:
    return "the message is nested too deeply" if isinstance(e, RecursionError) else str(e)


class _PeerGone(Exception):
    pass


class _Request:
    __slots__ = (
        "active", "breaks", "chars", "ended", "held", "identity", "link", "pending", "rid",
        "task",
    )  # fmt: skip

    def __init__(self, identity: bytes, rid: int) -> None:
        self.identity = identity
        self.rid = rid
        self.task: asyncio.Task[None] | None = None
        self.link: ClientLink | None = None
        """Every write to the client about this request, while its task serves it."""
        self.active: ActiveRequest | None = None
        """Set once admitted (synchronously after admission: no await in between)."""
        self.held: HeldText | None = None
        """The open text's rewriting (dictionaries, normalisation), when it has a plan."""
        self.breaks: BreakScanner | None = None
        """The open text's break tags, read before ``held`` rewrites the text around them (a
        tag split across appends is held in it: at most ``MAX_TAG_CHARS``)."""
        self.pending: list[AppendText] = []
        """Text that arrived while the request waited for admission."""
        self.chars = 0
        """The client's characters of this request until it is admitted (its ``input`` and
        the pending appends), counted when they arrive against ``gateway.max_input_chars``;
        from admission on, the request's ``text_chars`` counts them, also as they arrive:
        text held back (by ``held``) counts as much as text sent upstream."""
        self.ended = False
        """The request's one Done or Error is sent (or none is due: cancelled while queued)."""

    @property
    def key(self) -> tuple[bytes, int]:
        return (self.identity, self.rid)


class ZmqFrontend:
    def __init__(self, gateway: Gateway, endpoint: str) -> None:
        self._gateway = gateway
        self.endpoint = endpoint
        self._sock: zmq.asyncio.Socket | None = None
        self._requests: dict[tuple[bytes, int], _Request] = {}
        self._keys = ApiKeys(gateway.config.gateway.api_keys)
        self._max_message_bytes = gateway.config.gateway.zmq_max_message_bytes
        self._watermark = watermark_of(gateway.config)

    async def run(self) -> None:
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        # Bounds every frame before it is read: the API key is inside the message.
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        sock.bind(self.endpoint)
        self._sock = sock
        log.info("ZeroMQ clients on %s", self.endpoint)
        try:
            async for frames in incoming_multipart(sock):
                try:
                    await self._handle(frames)
                except Exception:  # one bad message must not stop the front end
                    log.exception("error handling a ZeroMQ client message")
                    with contextlib.suppress(Exception):
                        await self._reply(
                            frames[0], Error(None, 500, "internal_error", "internal server error")
                        )
        finally:
            for req in list(self._requests.values()):
                self._forget(req)
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
        except (*UNDECODABLE, RecursionError) as e:
            # RecursionError: deep nesting that the decoder skips over while it looks for
            # the ``type`` tag (a nested value where a field is expected is refused at once).
            rid = _request_id_of(payload)
            open_req = self._requests.get((identity, rid)) if rid is not None else None
            if open_req is not None:  # a bad message about an open request ends that request
                await self._fail(open_req, StreamError("invalid_message", _why(e), 400))
            else:
                await self._reply(identity, Error(rid, 400, "invalid_message", _why(e)))
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
            req = _Request(identity, msg.request_id)
            req.chars = len(msg.input)
            self._requests[key] = req
            req.task = asyncio.create_task(self._serve(msg, req))
            # Also when cancelled before it ran (a Speak and its Cancel in one burst).
            req.task.add_done_callback(functools.partial(self._task_done, req))
            return
        if req is None:
            await self._reply(
                identity, Error(msg.request_id, 400, "unknown_request", "no such open request")
            )
        elif isinstance(msg, AppendText):
            if req.active is None:
                req.chars += len(msg.text)
                limit = self._gateway.config.gateway.max_input_chars
                if req.chars > limit:
                    e = open_text_too_long(req.chars, limit)
                    await self._fail(req, StreamError(e.code, e.message, e.status))
                elif len(req.pending) >= MAX_PENDING_APPENDS:
                    await self._fail(
                        req,
                        StreamError(
                            "too_many_messages",
                            f"more than {MAX_PENDING_APPENDS} appends while the request waits "
                            "for admission",
                            400,
                        ),
                    )
                else:
                    req.pending.append(msg)
            else:
                self._append(req, msg)
        elif isinstance(msg, Cancel):
            if req.active is None:  # still queued: it ends without an answer
                req.ended = True
                self._forget(req)
                if req.task is not None:
                    req.task.cancel()
            else:
                self._fail_admitted(
                    req, StreamError(CLIENT_CANCELLED, "cancelled by the client", 499)
                )

    def _forget(self, req: _Request) -> None:
        if self._requests.get(req.key) is req:
            del self._requests[req.key]

    def _task_done(self, req: _Request, task: asyncio.Task[None]) -> None:
        self._forget(req)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("ZeroMQ request %d failed", req.rid, exc_info=exc)

    async def _end(
        self, req: _Request, msg: Done | Error, active: ActiveRequest | None = None
    ) -> None:
        """Send the request's one Done or Error (nothing if it already has its end); for
        an ``active`` (admitted) request, wait for room in the client's pipe as audio does."""
        if req.ended:
            return
        req.ended = True
        try:
            if active is None:
                pending = self._reply(req.identity, msg)
            else:
                pending = self._send_bounded(req.identity, msg)
            if req.link is None:
                await pending  # its task has not started, or has ended: nothing to time
            else:
                await req.link.write(pending, 0, active)
        finally:
            self._forget(req)  # its request_id is free once the client can know it ended

    async def _fail(self, req: _Request, error: StreamError) -> None:
        """End ``req`` with ``error``, whether it is admitted or still queued."""
        if req.active is not None:
            self._fail_admitted(req, error)
            return
        # Queued: its task has sent nothing, and is stopped before it can.
        if req.task is not None:
            req.task.cancel()
        await self._end(
            req, Error(req.rid, error.status, error.code, error.message, error.retry_after_s)
        )

    def _fail_admitted(self, req: _Request, error: StreamError) -> None:
        """Fail an admitted request's stream: its task answers (a no-op once it ended)."""
        assert req.active is not None
        req.active.fail(error)

    def _append(self, req: _Request, msg: AppendText, counted: bool = False) -> None:
        """Send ``msg``'s text upstream (what ``held`` lets through). Its characters count
        against the limit here, as they arrive, before any is held back; ``counted``: a
        pending append, counted when it arrived."""
        assert req.active is not None
        text = msg.text
        chars = 0 if counted else len(text)
        try:
            if req.held is not None or req.breaks is not None:
                check_text(text, None, param="text", allow_empty=True)  # a NUL, before holding
                if req.active.text_chars + chars <= self._gateway.config.gateway.max_input_chars:
                    text = self._open_text(req, text, msg.final)
                else:
                    text = ""  # refused below: nothing more is held
            req.active.append_text(text, final=msg.final, chars=chars)
        except APIError as e:  # a bad break tag included (BreakError)
            self._fail_admitted(req, StreamError(e.code, e.message, e.status))

    @staticmethod
    def _open_text(req: _Request, text: str, final: bool) -> str:
        """A piece of open text as the request takes it: its break tags read (and checked)
        first, the words around them rewritten by the plan (``held``), the tags written back
        whole (``gateway.text.pauses`` cuts the runs at them)."""
        held = req.held
        if req.breaks is None:
            return held.feed(text) + (held.flush() if final else "") if held else text
        pieces = req.breaks.feed(text)
        if final:
            pieces += req.breaks.flush()
        out: list[Piece] = []
        for p in pieces:
            if isinstance(p, Pause):
                if held is not None:
                    out.append(held.flush())  # the words before a tag are complete
                out.append(p)
            else:
                out.append(held.feed(p) if held is not None else p)
        if final and held is not None:
            out.append(held.flush())
        return join_breaks(out)

    async def _params(self, msg: Speak) -> SpeechParams:
        self._keys.check(msg.api_key, ZMQ_KEY_HINT)
        g = self._gateway
        plan = await g.speech_text.plan(
            msg.pronunciation_dictionary_locators,
            msg.apply_text_normalization,
            msg.api_key,
            g.languages.resolve(msg.language, msg.voice or None),
        )
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
            sampling=sampling_overrides(msg),
            text_open=msg.text_open,
            text_plan=plan,
            max_break_ms=cap_ms(self._gateway.config.gateway.max_break_s),
        )

    async def _send_bounded(self, identity: bytes, msg: ServerMessage) -> None:
        """Send, waiting while the client's pipe is full. Awaited through the request's
        ``write``: the stall watchdog bounds the wait."""
        assert self._sock is not None
        frames = [identity, encoder.encode(msg)]
        while True:
            try:
                await self._sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # the client's pipe is full: wait (the watchdog bounds this)
                await asyncio.sleep(RETRY_SEND_S)
            except zmq.ZMQError as e:
                if e.errno == errno.EHOSTUNREACH:
                    raise _PeerGone from None
                raise

    async def _serve(self, msg: Speak, req: _Request) -> None:
        on_abort = req.task.cancel if req.task is not None else None
        with self._gateway.links.open(Api.ZMQ, on_abort, key=msg.api_key or "") as link:
            req.link = link
            try:
                await self._serve_on(msg, req, link)
            finally:
                req.link = None

    async def _serve_on(self, msg: Speak, req: _Request, link: ClientLink) -> None:
        identity, rid = req.identity, req.rid
        encoder: AudioEncoder | None = None
        try:
            params = await self._params(msg)
            if msg.text_open:
                req.breaks = BreakScanner(cap_ms(self._gateway.config.gateway.max_break_s))
                if params.text_plan is not None:
                    req.held = HeldText(params.text_plan)
                text = self._open_text(req, params.text, final=False)
                params = msgspec.structs.replace(params, text=text, text_plan=None)
            else:
                params = params.spoken()
            encoder = make_output(params.output, params.speed)
            async with self._gateway.requests.open(
                params,
                link,
                text_open=msg.text_open,
                traceparent=msg.traceparent or "",
                text_chars=req.chars if msg.text_open else None,
                cache=of_field(msg.cache),
            ) as active:
                req.active = active
                for pending in req.pending:
                    self._append(req, pending, counted=True)
                req.pending.clear()
                started = Started(
                    rid, active.stream.stream_id, params.output.sample_rate,
                    params.response_format, watermark=self._watermark,
                )  # fmt: skip
                await link.write(self._reply(identity, started))
                try:
                    await self._stream_audio(req, active, encoder)
                except StreamFailed as e:
                    if e.error.code == CLIENT_CANCELLED:
                        seconds = round(active.audio_seconds, 4)
                        await self._end(req, Done(rid, "cancelled", seconds, 0), active)
                    else:
                        err = APIError.from_stream_error(e.error)
                        error = Error(rid, err.status, err.code, err.message, err.retry_after_s)
                        await self._end(req, error, active)
        except APIError as e:
            await self._end(req, Error(rid, e.status, e.code, e.message, e.retry_after_s))
        except _PeerGone:
            req.ended = True  # nobody to answer; leaving the request cancelled the stream
        except asyncio.CancelledError:
            # Torn down (a client that stopped reading, the gateway stopping): say why, if
            # the stream knows, to whoever may still read. A queued request's end is sent
            # by whoever cancelled it.
            error = req.active.stream.error if req.active is not None else None
            if error is not None:
                with contextlib.suppress(Exception):
                    await self._end(req, Error(rid, error.status, error.code, error.message))
            raise
        except Exception:
            log.exception("ZeroMQ request %d failed", rid)
            await self._end(req, Error(rid, 500, "internal_error", "internal server error"))
        finally:
            if encoder is not None:
                encoder.close()
            self._forget(req)

    async def _stream_audio(
        self, req: _Request, active: ActiveRequest, encoder: AudioEncoder
    ) -> None:
        """Audio messages in order, then Done; raises StreamFailed if the stream fails."""
        identity, rid = req.identity, req.rid
        stream = active.stream
        write, send = active.link.write, self._send_bounded
        seq = 0
        while chunks := await stream.next_chunks():
            for chunk in chunks:
                data = encoder.encode(chunk)
                if data:
                    await write(send(identity, Audio(rid, seq, data)), len(data), active)
                    seq += 1
        tail = encoder.finish()
        if tail:
            await write(send(identity, Audio(rid, seq, tail)), len(tail), active)
        end = stream.end
        done = Done(
            rid,
            end.reason if end else "stop",
            round(active.audio_seconds, 4),
            end.frames if end else 0,
            active.cache_state or "",
        )
        await self._end(req, done, active)
        active.complete()

    async def close(self) -> None:
        """Stop every request; one still unanswered is told that the gateway stopped."""
        reqs = list(self._requests.values())
        tasks = [r.task for r in reqs if r.task is not None]
        if self._sock is not None:
            for r in reqs:
                with contextlib.suppress(zmq.ZMQError):
                    await self._end(r, Error(r.rid, 503, "shutdown", "the gateway stopped"))
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
