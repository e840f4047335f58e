"""Python client of the gateway's ZeroMQ protocol (``orpheus_wire.zeromq``).

Synchronous (one request at a time per client)::

    with Client("tcp://127.0.0.1:8001") as c:
        pcm = b"".join(c.speech("Hello there.", voice="tara"))

asyncio (many concurrent requests on one socket; text may be streamed in)::

    async with AsyncClient("tcp://127.0.0.1:8001") as c:
        async for chunk in c.speech("Hello there.", voice="tara"):
            play(chunk)
        async with c.stream(voice="tara") as s:
            await s.append("Hello ")
            await s.append("there.", final=True)
            async for chunk in s:
                play(chunk)

Audio is int16 LE mono 24 kHz for ``response_format="pcm"`` (the default); other formats
yield their encoded bytes. Server failures raise ``SpeechError`` with the HTTP status the
same failure has over HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from types import TracebackType
from typing import Any, Self

import zmq
import zmq.asyncio

from orpheus_wire.zeromq import (
    AppendText,
    Audio,
    Cancel,
    Done,
    Error,
    ServerMessage,
    Speak,
    Started,
    encoder,
    server_decoder,
)

DEFAULT_TIMEOUT_S = 60.0


class SpeechError(Exception):
    """The server refused or failed a request."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message


def _speak(request_id: int, text: str, api_key: str | None, **kw: Any) -> Speak:
    """``kw``: ``Speak``'s fields; a name it does not have is a TypeError here, None is
    left out (the server's default)."""
    fields = {k: v for k, v in kw.items() if v is not None}
    return Speak(request_id=request_id, input=text, api_key=api_key, **fields)


class Client:
    """Blocking client; one request at a time."""

    def __init__(
        self, endpoint: str, *, api_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(endpoint)
        self._api_key = api_key
        self._timeout_ms = int(timeout_s * 1000)
        self._ids = itertools.count(1)

    def speech(
        self,
        text: str,
        *,
        voice: str = "",
        response_format: str = "pcm",
        speed: float = 1.0,
        traceparent: str | None = None,
        language: str | None = None,
        **sampling: float | None,
    ) -> Iterator[bytes]:
        """Yield the audio of ``text`` as it arrives; raise ``SpeechError`` on failure.
        ``sampling``: any of ``orpheus_wire.sampling.SamplingFields`` (``max_tokens``,
        ``seed``, ``temperature``, ``top_p``, ``repetition_penalty``, ``top_k``);
        ``traceparent``: the caller's W3C trace context (the server's spans continue it);
        ``language``: the text's (ISO 639-1; None: the voice's)."""
        rid = next(self._ids)
        msg = _speak(
            rid, text, self._api_key, voice=voice, response_format=response_format, speed=speed,
            traceparent=traceparent, language=language, **sampling,
        )  # fmt: skip
        self._sock.send(encoder.encode(msg))
        finished = False
        try:
            while True:
                if not self._sock.poll(self._timeout_ms):
                    raise TimeoutError(f"no message from the server in {self._timeout_ms} ms")
                reply = server_decoder.decode(self._sock.recv())
                if reply.request_id not in (rid, None):
                    continue  # a late message of an earlier, abandoned request
                if isinstance(reply, Audio):
                    yield reply.data
                elif isinstance(reply, Done):
                    finished = True
                    return
                elif isinstance(reply, Error):
                    finished = True
                    raise SpeechError(reply.status, reply.code, reply.message)
        finally:
            if not finished:
                self._sock.send(encoder.encode(Cancel(request_id=rid)))

    def close(self) -> None:
        self._sock.close(linger=0)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncSpeechStream:
    """One request whose text may be sent in pieces; iterate it for the audio."""

    def __init__(self, client: AsyncClient, request_id: int, timeout_s: float) -> None:
        self._client = client
        self.request_id = request_id
        self._timeout_s = timeout_s
        self._queue: asyncio.Queue[ServerMessage] = asyncio.Queue()
        self.finished = False
        self.started: Started | None = None
        self.done: Done | None = None

    async def append(self, text: str, *, final: bool = False) -> None:
        await self._client._send(AppendText(request_id=self.request_id, text=text, final=final))

    async def end(self) -> None:
        """No more text."""
        await self.append("", final=True)

    async def cancel(self) -> None:
        if not self.finished:
            self.finished = True
            await self._client._send(Cancel(request_id=self.request_id))

    def _deliver(self, msg: ServerMessage) -> None:
        self._queue.put_nowait(msg)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while not self.finished:
            try:
                # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
                # meets a message in the same step, and the consumer would read on.
                async with asyncio.timeout(self._timeout_s):
                    msg = await self._queue.get()
            except TimeoutError:
                await self.cancel()
                raise
            if isinstance(msg, Audio):
                yield msg.data
            elif isinstance(msg, Started):
                self.started = msg
            elif isinstance(msg, Done):
                self.finished = True
                self.done = msg
            elif isinstance(msg, Error):
                self.finished = True
                raise SpeechError(msg.status, msg.code, msg.message)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel the request if it has not finished, and forget it."""
        with contextlib.suppress(zmq.ZMQError):
            await self.cancel()
        self._client._streams.pop(self.request_id, None)


class AsyncClient:
    """asyncio client; any number of concurrent requests share one DEALER socket."""

    def __init__(
        self, endpoint: str, *, api_key: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S
    ) -> None:
        self._endpoint = endpoint
        self._api_key = api_key
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._streams: dict[int, AsyncSpeechStream] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._send_lock: asyncio.Lock | None = None

    async def __aenter__(self) -> Self:
        self.open()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def open(self) -> None:
        if self._sock is not None:
            return
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        self._sock = sock
        self._send_lock = asyncio.Lock()
        self._receiver = asyncio.create_task(self._receive())

    async def aclose(self) -> None:
        for s in list(self._streams.values()):
            await s.close()
        if self._receiver is not None:
            self._receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._receiver
            self._receiver = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _send(self, msg: Speak | AppendText | Cancel) -> None:
        if self._sock is None or self._send_lock is None:
            raise RuntimeError("the client is not open (use `async with AsyncClient(...)`)")
        async with self._send_lock:
            await self._sock.send(encoder.encode(msg))

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            raw = await self._sock.recv()
            msg = server_decoder.decode(raw)
            if msg.request_id is None:
                continue  # a reply to a message the server could not decode: a client bug
            stream = self._streams.get(msg.request_id)
            if stream is not None:
                stream._deliver(msg)

    def stream(
        self,
        text: str = "",
        *,
        voice: str = "",
        response_format: str = "pcm",
        speed: float = 1.0,
        text_open: bool = True,
        traceparent: str | None = None,
        language: str | None = None,
        **sampling: float | None,
    ) -> _StreamStarter:
        """A request whose text is appended later (``append``/``end``); use ``async with``.
        ``sampling``: any of ``orpheus_wire.sampling.SamplingFields``, as ``Client.speech``;
        ``traceparent``: the caller's W3C trace context (the server's spans continue it)."""
        rid = next(self._ids)
        msg = _speak(
            rid, text, self._api_key, voice=voice, response_format=response_format, speed=speed,
            text_open=text_open, traceparent=traceparent, language=language, **sampling,
        )  # fmt: skip
        s = AsyncSpeechStream(self, rid, self._timeout_s)
        return _StreamStarter(self, s, msg)

    async def speech(self, text: str, **kw: Any) -> AsyncIterator[bytes]:
        """Yield the audio of ``text`` as it arrives; raise ``SpeechError`` on failure."""
        async with self.stream(text, text_open=False, **kw) as s:
            async for chunk in s:
                yield chunk


class _StreamStarter:
    """``async with client.stream(...) as s``: sends Speak on entry, cancels on early exit."""

    def __init__(self, client: AsyncClient, stream: AsyncSpeechStream, msg: Speak) -> None:
        self._client = client
        self._stream = stream
        self._msg = msg

    async def __aenter__(self) -> AsyncSpeechStream:
        self._client._streams[self._stream.request_id] = self._stream
        await self._client._send(self._msg)
        return self._stream

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._stream.close()
