"""What every front end shares, written once: the handler type, the body read, the error
conversion, the template of a streaming request, WebSocket JSON messages, an HTTP answer's
``X-Cache`` header.

Every write to a client goes through the ``ClientLink`` of its connection
(``gateway.link``: the stall clock, the bytes, the abort), a unit's life through its
request (``gateway.requests.ActiveRequest``); the ``api`` label is ``gateway.apis.Api``. A
front end never imports ``gateway.metrics``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable

import msgspec
from aiohttp import web

from gateway.cache.control import combined
from gateway.errors import APIError
from gateway.link import ClientLink
from gateway.schemas import SpeechParams, build_params
from gateway.service import Gateway
from gateway.streams import StreamFailed
from gateway.text.plan import TextPlan
from shm.messages import SamplingOverrides

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

UNIT_MAX_CHARS = 280
"""The longest unit the streaming protocols cut their text into (``text_units``)."""

_json = msgspec.json.Encoder()


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request's body, or ``APIError`` 413 past ``limit`` bytes."""
    if request.content_length is not None and request.content_length > limit:
        raise APIError(
            413,
            "request_too_large",
            f"request body of {request.content_length} bytes exceeds the {limit}-byte limit",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise APIError(
            413, "request_too_large", f"request body exceeds the {limit}-byte limit"
        ) from None


def api_error(e: APIError | StreamFailed) -> APIError:
    """A refusal (``APIError``) or a stream's failure in the workers, as an ``APIError``:
    a value to answer with, without the traceback of where it was raised (kept, a caught
    exception's traceback holds the frames whose locals hold what keeps it: a reference
    cycle per failed unit that only the cyclic collector frees, common/heap.py)."""
    return (
        e.with_traceback(None) if isinstance(e, APIError) else APIError.from_stream_error(e.error)
    )


def cache_header(states: Iterable[str | None]) -> dict[str, str]:
    """The ``X-Cache`` header of an HTTP answer made of units with these cache states (each
    a request's ``cache_state``, in the order spoken): ``hit``, ``partial`` or ``miss`` as
    ``combined`` decides, or no header when no unit could be cached (the cache off, pauses
    alone). It goes out with the answer's headers: a streamed answer of several units names
    the units spoken before its first bytes, a whole one all of them."""
    state = combined(states)
    return {} if state is None else {"X-Cache": state}


def abort_of(request: web.Request) -> Callable[[], None] | None:
    """What tears the client's connection down (a request's ``on_abort``)."""
    transport = request.transport
    return transport.abort if transport is not None else None


def stream_template(
    gateway: Gateway,
    *,
    voice: str | None,
    sampling: SamplingOverrides | None = None,
    response_format: str = "pcm",
    sample_rate: int | None = None,
    bitrate: str | None = None,
    speed: float | None = None,
    text_plan: TextPlan | None = None,
) -> SpeechParams:
    """The ``SpeechParams`` of a streaming connection (a socket, a session, a context) before
    any text: voice, output and sampling checked by ``build_params``; each unit it speaks is
    the template with the unit's text."""
    return build_params(
        gateway.voices,
        gateway.limits,
        text="",
        voice=voice,
        max_chars=None,
        text_param="text",
        allow_empty=True,
        response_format=response_format,
        sample_rate=sample_rate,
        bitrate=bitrate,
        speed=speed,
        sampling=sampling,
        text_plan=text_plan,
    )


async def send_json(link: ClientLink, ws: web.WebSocketResponse, msg: msgspec.Struct) -> None:
    """One JSON text message on ``ws`` (through its ``link``), unless the socket is closed."""
    if not ws.closed:
        await link.write(ws.send_str(_json.encode(msg).decode()))


async def send_json_quietly(
    link: ClientLink, ws: web.WebSocketResponse, msg: msgspec.Struct
) -> None:
    """``send_json`` for an error or an end: a client already gone is no further error."""
    with contextlib.suppress(ConnectionError):
        await send_json(link, ws, msg)
