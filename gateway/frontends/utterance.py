"""Speaking text units one after another: the core the streaming protocols share.

A connection of a voice-agent protocol (vLLM-Omni session, ElevenLabs context, Baseten
socket) turns its text into units (``gateway.frontends.text_units``) and speaks them in order on a
``Lane``: one unit at a time, each its own request through ``Gateway.requests`` (so
admission, the idle and slow-client watchdogs, metrics and upstream cancellation are the
same as for every other front end), whose audio goes out on the connection's ``ClientLink``
(``gateway.link``: every write, the connection's life). Cancelling the lane (a barge-in, a client that went
away) cancels the unit being spoken, which sends ``LlmCancel`` and aborts the vLLM request,
and drops the units queued behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import WSMessage, web

from gateway.cache.control import USE, CacheUse
from gateway.edge.auth import presented_key
from gateway.frontends.shared import abort_of
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.schemas import SpeechParams
from gateway.service import Gateway
from gateway.streams import silence_pcm
from shm.records import SAMPLE_RATE, StreamEnd

log = logging.getLogger(__name__)

Deliver = Callable[[ActiveRequest | None, list[bytes], bool], Awaitable[None]]
"""Called with the unit's request, each batch of its 24 kHz PCM chunks and whether it is the
unit's last (then possibly empty); writes what it sends through the link, naming the unit
(or, for audio it holds, the units of that audio when it sends it). The request is None for
the silence of a pause (``speak_unit``'s ``pause_ms``): audio of no request, which no model
made."""

MS_PER_BYTE = 1000.0 / (SAMPLE_RATE * 2)


def pcm_ms(n_bytes: int) -> float:
    return n_bytes * MS_PER_BYTE


async def speak_unit(
    gateway: Gateway,
    template: SpeechParams,
    text: str,
    link: ClientLink,
    deliver: Deliver,
    *,
    started_at: float | None = None,
    pause_ms: int = 0,
    cache: CacheUse = USE,
) -> StreamEnd | None:
    """Speak one unit: ``pause_ms`` of silence (its ``Unit.pause_ms``: the break tags before
    it), then ``text`` (cut from text ``check_text`` took; may be empty after a pause) with
    the voice and sampling of ``template`` (``build_params``'s, made when the protocol's
    session or context was configured), rewritten by its ``text_plan`` (dictionaries,
    normalisation) unless the caller did that already, on the connection's ``link``.

    The silence is the gateway's: delivered at once, with no request (no admission, no model
    token); the text after it is a request as any unit's (``cache``: what it lets the
    sentence audio cache do, ``gateway.cache.control``). Returns how the request ended
    (None: a pause alone). Raises ``APIError`` (not admitted) or ``StreamFailed`` (failed in
    the workers), after the audio that came before."""
    if pause_ms:
        await deliver(None, [silence_pcm(pause_ms)], not text)
    if not text:
        return None
    params = msgspec.structs.replace(template, text=text).spoken()
    async with gateway.requests.open(params, link, started_at=started_at, cache=cache) as active:
        stream = active.stream
        while True:
            chunks = await stream.next_chunks()
            last = stream.end is not None
            await deliver(active, chunks, last)
            if last or not chunks:
                break
        active.complete()
        return stream.end


class QueueCap:
    """What one connection may have waiting to be spoken (``gateway.ws_max_queued_chars``
    and ``gateway.ws_max_queued_sentences``): the text of the units queued on its lanes,
    not yet started, plus the text not yet cut into a unit. A protocol asks ``admits``
    before it takes a text message and refuses the message (a protocol error) if not."""

    def __init__(self, max_chars: int, max_units: int) -> None:
        self.max_chars = max_chars
        self.max_units = max_units
        self.chars = 0
        self.units = 0

    def admits(self, buffered_chars: int, new_chars: int) -> bool:
        return (
            self.chars + buffered_chars + new_chars <= self.max_chars
            and self.units < self.max_units
        )

    def refusal(self) -> str:
        return (
            f"too much text waiting to be spoken on this connection (at most "
            f"{self.max_chars} characters and {self.max_units} sentences); this message was "
            "not taken: send it again once audio has been delivered"
        )


class Lane:
    """Runs queued jobs one at a time, in order. Its task lives only while there are jobs
    (a finished ElevenLabs context leaves nothing behind). A job pushed with ``chars`` is a
    unit of text: it counts against ``cap`` until it starts or is dropped."""

    def __init__(self, name: str, cap: QueueCap | None = None) -> None:
        self._jobs: deque[tuple[Callable[[], Awaitable[None]], int]] = deque()
        self._cap = cap
        self._task: asyncio.Task[None] | None = None
        self._name = name
        self.busy = False
        """A job is running."""
        self.idle_since = time.monotonic()
        """When the lane last ran out of jobs (``time.monotonic()``)."""

    @property
    def idle(self) -> bool:
        return not self.busy and not self._jobs

    @property
    def quiet_since(self) -> float | None:
        """None while the lane has work, else when it last ran out of it."""
        return self.idle_since if self.idle else None

    def push(self, job: Callable[[], Awaitable[None]], chars: int = 0) -> None:
        if chars and self._cap is not None:
            self._cap.chars += chars
            self._cap.units += 1
        self._jobs.append((job, chars))
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self._name)

    async def _run(self) -> None:
        try:
            while self._jobs:
                job, chars = self._jobs.popleft()
                self._release(chars)
                self.busy = True
                try:
                    await job()
                except asyncio.CancelledError:
                    raise
                except ConnectionError as e:  # the client went away while we wrote to it
                    log.debug("%s: client gone: %s", self._name, e)
                except Exception:
                    log.exception("%s: a job failed", self._name)
                finally:
                    self.busy = False
        finally:
            self.idle_since = time.monotonic()
            if self._task is asyncio.current_task():
                self._task = None

    def _release(self, chars: int) -> None:
        if chars and self._cap is not None:
            self._cap.chars -= chars
            self._cap.units -= 1

    async def drained(self) -> None:
        """Wait until every job pushed so far has run."""
        done = asyncio.get_running_loop().create_future()

        async def mark() -> None:
            if not done.done():
                done.set_result(None)

        self.push(mark)
        await done

    async def cancel(self) -> None:
        """Drop the queued jobs and cancel the running one (its stream is cancelled upstream)."""
        while self._jobs:
            self._release(self._jobs.popleft()[1])
        self.idle_since = time.monotonic()
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def drain_while_open(ws: web.WebSocketResponse, lane: Lane) -> bool:
    """Wait until ``lane`` has run everything queued, unless the client closes the socket
    (or sends anything) first; then cancel the lane. True: drained."""
    drained = asyncio.ensure_future(lane.drained())
    received = asyncio.ensure_future(ws.receive())
    try:
        done, _ = await asyncio.wait({drained, received}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (drained, received):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    if drained in done:
        return True
    await lane.cancel()
    return False


async def receive_unless_idle(
    ws: web.WebSocketResponse, timeout_s: float, quiet_since: Callable[[], float | None]
) -> WSMessage:
    """The next message from ``ws``; ``TimeoutError`` once the connection has been idle for
    ``timeout_s``: no message from the client (any message counts, keepalives included) and
    nothing being spoken (``quiet_since()``: None while audio is being made, else when that
    last stopped, ``time.monotonic()``), whether or not an utterance is open."""
    start = time.monotonic()
    poll = max(timeout_s / 4, 0.05)
    while True:
        quiet = quiet_since()
        now = time.monotonic()
        if quiet is None:
            wait = poll  # speaking: look again soon after it stops
        else:
            wait = max(start, quiet) + timeout_s - now
            if wait <= 0:
                raise TimeoutError
        try:
            return await ws.receive(wait)
        except TimeoutError:
            continue


WS_HEARTBEAT_S = 30.0
"""Ping interval of the streaming WebSocket protocols: a dead peer is noticed within two."""


async def serve_websocket(
    request: web.Request,
    gateway: Gateway,
    api: str,
    serve: Callable[[web.WebSocketResponse, ClientLink], Awaitable[None]],
) -> web.WebSocketResponse:
    """Upgrade ``request``, run one protocol's ``serve`` on the socket and its link (every
    write to the client), close it however that ended (a client gone mid-write is the
    normal end of a barge-in, not an error)."""
    ws = web.WebSocketResponse(
        max_msg_size=gateway.config.gateway.max_body_bytes, heartbeat=WS_HEARTBEAT_S
    )
    with gateway.links.open(api, abort_of(request), key=presented_key(request)) as link:
        await link.write(ws.prepare(request))
        with contextlib.suppress(ConnectionError):
            await serve(ws, link)
        if not ws.closed:
            await link.write(ws.close())
    return ws
