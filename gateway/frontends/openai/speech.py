"""``POST /v1/audio/speech``: OpenAI-compatible streaming speech over chunked HTTP or SSE.

The status is decided by what comes first from the workers: the first audio chunk (200,
then the audio streams) or an error (its status, as a JSON error). Headers are sent only
then. A failure after the headers cuts the connection for ``stream_format=audio`` (the
client sees an incomplete chunked body, never a silently short file) and sends an
``error`` event for ``sse``.
"""

from __future__ import annotations

import logging

from aiohttp import web

from gateway.apis import Api
from gateway.audio.encoders import AudioEncoder
from gateway.audio.output import make_output
from gateway.cache.control import of_header
from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.openai.body import decode_speech_request, speech_params
from gateway.frontends.openai.sse import delta_event, done_event, error_event
from gateway.frontends.shared import Handler, abort_of, cache_header, read_body
from gateway.link import ClientLink
from gateway.requests import ActiveRequest
from gateway.schemas import SpeechParams
from gateway.service import Gateway
from gateway.streams import StreamFailed
from gateway.text.breaks import cap_ms

log = logging.getLogger(__name__)

PATH = "/v1/audio/speech"
SSE_CONTENT_TYPE = "text/event-stream"


def routes(gateway: Gateway) -> list[web.RouteDef]:
    return [web.post(PATH, speech_handler(gateway))]


def speech_handler(gateway: Gateway) -> Handler:
    g = gateway.config.gateway

    async def create_speech(request: web.Request) -> web.StreamResponse:
        started_at = gateway.loop.time()
        body = await read_body(request, g.max_body_bytes)
        req = decode_speech_request(body)
        plan = await gateway.speech_text.plan(
            req.pronunciation_dictionary_locators,
            req.apply_text_normalization,
            presented_key(request),
            gateway.languages.resolve(req.language, req.voice_name),
        )
        params = speech_params(
            req, gateway.voices, gateway.limits, g.max_input_chars, plan, cap_ms(g.max_break_s)
        )
        api = Api.OPENAI_SSE if params.stream_format == "sse" else Api.OPENAI_HTTP
        return await respond(request, gateway, params, api, started_at)

    return create_speech


async def respond(
    request: web.Request, gateway: Gateway, params: SpeechParams, api: Api, started_at: float
) -> web.StreamResponse:
    """Speak ``params`` (checked by ``build_params``) as one streamed HTTP response, as this
    module's docstring says: also Baseten's ``predict`` (``gateway.frontends.baseten.predict``).
    The text is rewritten by the params' ``text_plan`` first. The request's ``Cache-Control``
    says what the sentence audio cache may do (``gateway.cache.control``); the answer's
    ``X-Cache`` says whether it came from it (``hit``), in part (``partial``: its first
    sentences) or was synthesised (``miss``), when the cache is on and the text is one unit
    (``cache_header``)."""
    params = params.spoken()
    encoder = make_output(params.output, params.speed)
    try:
        with gateway.links.open(api, abort_of(request), key=presented_key(request)) as link:
            async with gateway.requests.open(
                params,
                link,
                started_at=started_at,
                cache=of_header(request.headers.get("Cache-Control")),
            ) as active:
                return await _stream(request, link, active, encoder)
    finally:
        encoder.close()


async def _stream(
    request: web.Request, link: ClientLink, active: ActiveRequest, encoder: AudioEncoder
) -> web.StreamResponse:
    stream = active.stream
    sse = active.params.stream_format == "sse"
    try:
        chunks = await stream.next_chunks()
    except StreamFailed as e:
        raise APIError.from_stream_error(e.error) from None

    content_type = SSE_CONTENT_TYPE if sse else active.params.output.content_type
    headers = {
        "Content-Type": content_type,
        "Cache-Control": "no-cache",
        "X-Accel-Buffering": "no",
        **cache_header([active.cache_state]),
    }
    resp = web.StreamResponse(status=200, headers=headers)
    encode = encoder.encode
    write = link.write  # every write: timed for the watchdog, its bytes counted

    try:
        await write(resp.prepare(request))
        while chunks:
            # Everything buffered since the last write goes out in one write: a client (or
            # this process) that fell behind catches up with one syscall, not one per chunk.
            data = encode(chunks[0]) if len(chunks) == 1 else b"".join(map(encode, chunks))
            if data:
                await write(resp.write(delta_event(data) if sse else data), len(data), active)
            chunks = await stream.next_chunks()
        tail = encoder.finish()
        if tail:
            await write(resp.write(delta_event(tail) if sse else tail), len(tail), active)
        if sse:
            end = stream.end
            await write(resp.write(done_event(end.tokens if end is not None else 0)))
        await write(resp.write_eof())
        active.complete()
    except StreamFailed as e:
        err = APIError.from_stream_error(e.error)
        log.info("stream %#x failed after audio: %s", stream.stream_id, err.message)
        if sse and e.error.code != "slow_client":
            await write(resp.write(error_event(err)))
            await write(resp.write_eof())
        else:
            link.abort()  # the client must not mistake a truncated stream for a whole one
    except ConnectionError:
        pass  # the client went away; leaving the request cancels the stream upstream
    return resp
