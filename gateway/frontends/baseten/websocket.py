"""Baseten's Orpheus WebSocket at ``/v1/baseten/orpheus/websocket``.

What LiveKit's Baseten plugin speaks with ``model="orpheus"`` (and Baseten's Orpheus
truss serves)::

    client: {"voice": "tara", "max_tokens": 2000, "buffer_size": 10}   first
    client: "Hello"  "there."  ...                                      raw text
    client: "__END__"
    server: <binary int16 LE mono 24 kHz PCM> ...  then close 1000

One utterance per connection. Text is spoken a sentence at a time as soon as a sentence
is complete (``buffer_size``, the truss's words per request, is accepted and not needed;
``max_tokens`` is an upper bound the server's own length cap already enforces). The old
plugin sends one word per message with no spaces, the new one sends text pieces as the
LLM writes them: pieces are joined with a space until a piece carries its own whitespace,
then taken as they come. The protocol has no error message: a failure closes the socket
with 1008 (bad request), 1013 (over capacity, retry later) or 1011 (server error) and the
reason. A client that closes the socket cancels the stream all the way into vLLM.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web

from gateway.apis import Api
from gateway.cache.control import of_header
from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.shared import UNIT_MAX_CHARS, Handler, api_error, stream_template
from gateway.frontends.text_units import Unit, UnitSplitter
from gateway.frontends.utterance import (
    Lane,
    QueueCap,
    drain_while_open,
    receive_unless_idle,
    serve_websocket,
    speak_unit,
)
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.schemas import check_text, sampling_overrides
from gateway.service import Gateway
from gateway.streams import StreamFailed
from gateway.text.breaks import BreakError, cap_ms
from orpheus_wire.sampling import SamplingFields
from orpheus_wire.text import Locator
from shm.messages import UNDECODABLE

log = logging.getLogger(__name__)

PATH = "/v1/baseten/orpheus/websocket"
API = Api.BASETEN
END = "__END__"


class StartMessage(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """The first message; other fields are ignored. ``max_tokens`` and ``buffer_size`` are
    accepted and not used (see the module docstring); the values of the others are checked
    by ``build_params`` (the sampling fields are ``SamplingFields``')."""

    voice: str | None = None
    buffer_size: int | None = None
    language: str | None = None
    pronunciation_dictionary_locators: list[Locator] | None = None
    apply_text_normalization: str | None = None


_start_decoder = msgspec.json.Decoder(StartMessage)


def close_code(status: int) -> int:
    if status in (429, 503):
        return int(WSCloseCode.TRY_AGAIN_LATER)
    if 400 <= status < 500:
        return int(WSCloseCode.POLICY_VIOLATION)
    return int(WSCloseCode.INTERNAL_ERROR)


class _TextJoiner:
    """Pieces to text: words joined by spaces, or raw pieces once one carries whitespace."""

    def __init__(self) -> None:
        self._raw = False
        self._any = False

    def join(self, piece: str) -> str:
        if piece[:1].isspace() or piece[-1:].isspace():
            self._raw = True
        out = piece if self._raw or not self._any else " " + piece
        self._any = True
        return out


async def _close(link: ClientLink, ws: web.WebSocketResponse, err: APIError) -> None:
    if not ws.closed:
        with contextlib.suppress(ConnectionError):
            await link.write(
                ws.close(code=close_code(err.status), message=err.message.encode()[:120])
            )


async def _serve(
    ws: web.WebSocketResponse, link: ClientLink, request: web.Request, gateway: Gateway
) -> None:
    g = gateway.config.gateway
    cache = of_header(request.headers.get("Cache-Control"))
    try:
        first = await ws.receive(g.ws_start_timeout_s)
    except TimeoutError:
        await _close(link, ws, APIError(400, "timeout", "no start message"))
        return
    if first.type != WSMsgType.TEXT:
        if first.type == WSMsgType.BINARY:
            await _close(link, ws, APIError(400, "invalid_message", "the first message is JSON"))
        return
    try:
        start = _start_decoder.decode(first.data)
        language = gateway.languages.resolve(start.language, start.voice or None)
        plan = await gateway.speech_text.plan(
            start.pronunciation_dictionary_locators,
            start.apply_text_normalization,
            presented_key(request),
            language,
        )
        params = stream_template(
            gateway,
            voice=start.voice or None,
            sampling=sampling_overrides(start, length=False),
            text_plan=plan,
        )
    except UNDECODABLE as e:
        await _close(link, ws, APIError(400, "invalid_message", f"invalid start message: {e}"))
        return
    except APIError as e:
        await _close(link, ws, e)
        return
    cap = QueueCap(g.ws_max_queued_chars, g.ws_max_queued_sentences)
    lane = Lane("baseten-socket", cap)
    failure: list[APIError] = []

    async def send_all(chunks: list[bytes]) -> None:
        for c in chunks:
            await ws.send_bytes(c)

    async def deliver(unit: ActiveRequest | None, chunks: list[bytes], last: bool) -> None:
        if chunks:
            await link.write(send_all(chunks), sum(map(len, chunks)), unit)

    def job(unit: Unit) -> Callable[[], Awaitable[None]]:
        started_at = gateway.loop.time()

        async def run() -> None:
            if failure:
                return
            try:
                await speak_unit(
                    gateway, params, unit.text, link, deliver,
                    started_at=started_at, pause_ms=unit.pause_ms, cache=cache,
                )  # fmt: skip
            except (APIError, StreamFailed) as e:
                failure.append(api_error(e))
                await _close(link, ws, failure[0])

        return run

    splitter = UnitSplitter("sentence", UNIT_MAX_CHARS, cap_ms(g.max_break_s), language=language)
    joiner = _TextJoiner()
    try:
        while not failure:
            msg = await receive_unless_idle(ws, g.ws_text_idle_timeout_s, lambda: lane.quiet_since)
            if msg.type == WSMsgType.BINARY:
                await _close(link, ws, APIError(400, "invalid_message", "send text, not binary"))
                return
            if msg.type != WSMsgType.TEXT:
                if failure:  # a unit failed and is closing the socket with its code
                    await lane.drained()
                return  # the client went away: finally cancels the work in flight
            text = msg.data
            if text == END:
                try:
                    units = splitter.flush()
                except BreakError as e:  # a break tag that never closed
                    await _close(link, ws, e)
                    return
                for unit in units:
                    lane.push(job(unit), len(unit.text))
                if not await drain_while_open(ws, lane):
                    return  # the client closed before the end: cancelled
                if not failure and not ws.closed:
                    await link.write(ws.close(code=WSCloseCode.OK, message=b"done"))
                return
            try:
                check_text(text, None, param="text", allow_empty=True)
            except APIError as e:
                await _close(link, ws, e)
                return
            if not cap.admits(len(splitter.pending), len(text) + 1):
                await _close(link, ws, APIError(429, "input_queue_full", cap.refusal()))
                return
            if text:
                try:
                    units = splitter.feed(joiner.join(text))
                except BreakError as e:  # the socket's error: closed with its code
                    await _close(link, ws, e)
                    return
                for unit in units:
                    lane.push(job(unit), len(unit.text))
    except TimeoutError:
        await _close(link, ws, APIError(408, "timeout", "no text for too long"))
    finally:
        await lane.cancel()


def websocket_handler(gateway: Gateway) -> Handler:
    async def orpheus_websocket(request: web.Request) -> web.WebSocketResponse:
        return await serve_websocket(
            request, gateway, API, lambda ws, link: _serve(ws, link, request, gateway)
        )

    return orpheus_websocket
