"""The aiohttp application: routes, JSON errors, API keys (``gateway.edge.auth``), and the small
info endpoints."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from gateway import jobs, warm
from gateway.apis import Api
from gateway.cache import routes as cache_routes
from gateway.cache.keys import job_tenant
from gateway.disclosure import detect
from gateway.disclosure.headers import mark_audio_answers
from gateway.edge.auth import ApiKeys, http_middleware, presented_key
from gateway.edge.browser_guard import BrowserGuard, add_cors_headers
from gateway.edge.listener import body_deadline
from gateway.errors import APIError
from gateway.frontends import baseten, elevenlabs, omni, openai
from gateway.frontends.registry import HTTP_FRONTENDS
from gateway.frontends.shared import Handler
from gateway.jobs.store import owner_of
from gateway.service import Gateway
from gateway.voices import custom_routes

log = logging.getLogger(__name__)

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
_json = msgspec.json.Encoder()
_CODE_BY_STATUS = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    400: "invalid_request",
}


def json_response(
    obj: object, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=_json.encode(obj), status=status, content_type="application/json", headers=headers
    )


AUDIO_PATHS = (
    openai.speech.PATH,
    omni.speech_stream.PATH,
    elevenlabs.messages.WS_PATH,
    elevenlabs.messages.WS_SINGLE_PATH,
    elevenlabs.messages.STREAM_PATH,
    elevenlabs.messages.TIMESTAMPS_PATH,
    elevenlabs.messages.CONVERT_PATH,
    elevenlabs.messages.CONVERT_TIMESTAMPS_PATH,
    *(elevenlabs.dialogue.PATH + end for end in ("", "/stream", "/stream/with-timestamps")),
    elevenlabs.dialogue.PATH + "/with-timestamps",
    baseten.websocket.PATH,
    baseten.predict.PATH,
    jobs.routes.AUDIO_PATH,
)
"""The routes that answer audio: their answers say it is AI-generated (``gateway.disclosure``)."""

EARLY_REFUSAL_ROUTES = {
    openai.speech.PATH: Api.OPENAI_HTTP,
    elevenlabs.messages.STREAM_PATH: Api.ELEVENLABS,
    elevenlabs.messages.TIMESTAMPS_PATH: Api.ELEVENLABS,
    elevenlabs.messages.CONVERT_PATH: Api.ELEVENLABS,
    elevenlabs.messages.CONVERT_TIMESTAMPS_PATH: Api.ELEVENLABS,
    baseten.predict.PATH: Api.BASETEN,
}
"""The HTTP speech routes whose request is one admission from the start: a key refused
lately is refused again before the body is read (``Admission.refuse_early``), counted under
this ``api`` label (an OpenAI request's ``stream_format`` is in the body: ``http``)."""

ELEVENLABS_PATHS = ("/v1/text-to-speech/", "/v1/text-to-dialogue")
"""Routes whose clients (ElevenLabs' SDKs) read its error shape on a 429."""


def error_response(err: APIError, *, elevenlabs: bool = False) -> web.Response:
    return web.Response(
        body=err.to_elevenlabs_json() if elevenlabs and err.status == 429 else err.to_json(),
        status=err.status,
        content_type="application/json",
        headers=err.headers(),
    )


def early_refusals(gateway: Gateway) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware of ``gateway.early_refusal``: a POST to a route of
    ``EARLY_REFUSAL_ROUTES`` whose key ``Admission.refuse_early`` refuses is answered its 429
    before its body is read (after the key checks, which it needs)."""

    @web.middleware
    async def refuse_early(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method == "POST":
            resource = request.match_info.route.resource
            api = EARLY_REFUSAL_ROUTES.get(resource.canonical) if resource is not None else None
            if api is not None and (
                error := gateway.admission.refuse_early(presented_key(request))
            ):
                gateway.metrics.count_request(api, "rejected")
                raise error
        return await handler(request)

    return refuse_early


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is OpenAI-shaped JSON with the right status, and never kills the process."""
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e, elevenlabs=request.path.startswith(ELEVENLABS_PATHS))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err = APIError(e.status, _CODE_BY_STATUS.get(e.status, "http_error"), e.reason)
        resp = error_response(err)
        if "Allow" in e.headers:
            resp.headers["Allow"] = e.headers["Allow"]
        return resp
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError(500, "internal_error", "internal server error"))


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "orpheus-serve"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: str = "list"


def build_app(gateway: Gateway) -> web.Application:
    g = gateway.config.gateway
    # The body deadline is outermost: it closes the connection of the 408 that json_errors
    # renders from the read it failed.
    middlewares: list[Callable[..., Awaitable[web.StreamResponse]]] = [
        body_deadline(g.body_timeout_s, gateway.metrics),
        json_errors,
    ]
    keys = ApiKeys(g.api_keys)
    # After json_errors, which renders their 401/403: browsers first, then keys.
    middlewares.append(BrowserGuard(g, keys.required).middleware())
    middlewares.append(http_middleware(keys, ApiKeys(g.admin_keys), metrics=g.metrics_require_key))
    if g.early_refusal and not gateway.config.cache.enabled:  # as the gateway's admission
        middlewares.append(early_refusals(gateway))
    if gateway.tracing is not None:  # off: no middleware, no cost
        incoming = gateway.requests.incoming_traceparent

        @web.middleware
        async def trace_context(request: web.Request, handler: Handler) -> web.StreamResponse:
            """The request's W3C ``traceparent`` header, for ``RequestTracker.open``."""
            incoming.set(request.headers.get("traceparent"))
            return await handler(request)

        middlewares.append(trace_context)

    app = web.Application(client_max_size=g.max_body_bytes, middlewares=middlewares)
    app.on_response_prepare.append(add_cors_headers)
    app.on_response_prepare.append(mark_audio_answers(AUDIO_PATHS, gateway.config))
    models = ModelList(
        [ModelCard(gateway.config.llm.model), *(ModelCard(n) for n in g.served_model_names)]
    )

    async def health(_: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def ready(_: web.Request) -> web.Response:
        state = gateway.readiness()
        return json_response(state, status=200 if state.ready else 503)

    async def metrics(_: web.Request) -> web.Response:
        # The one node-wide ratio no stream event keeps current (another process's streams,
        # an engine going down): computed at the scrape, the newest write of any process wins.
        gateway.metrics.saturation.set(gateway.admission.saturation())
        gateway.metrics.capacity.set(gateway.capacity_gauge())
        body, content_type = gateway.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    custom = gateway.custom_voices
    listing = gateway.voices.listing

    async def voices(_: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(None, custom.listing, listing.aliases, listing.default)
        return json_response(body)

    elevenlabs_models = elevenlabs.models_handler(gateway)

    async def list_models(request: web.Request) -> web.Response:
        if elevenlabs.asks_for_models(request):  # the ElevenLabs SDKs' models.list
            return await elevenlabs_models(request)
        return json_response(models)

    async def playground(_: web.Request) -> web.FileResponse:
        return web.FileResponse(os.path.join(STATIC_DIR, "index.html"))

    for frontend in HTTP_FRONTENDS:  # each protocol's routes (gateway.frontends)
        app.router.add_routes(frontend.routes(gateway))
    app.router.add_get("/v1/audio/voices", voices)
    app.router.add_post("/v1/audio/voices", custom_routes.create_handler(custom))
    app.router.add_delete("/v1/audio/voices/{voice_id}", custom_routes.delete_handler(custom))
    app.router.add_post("/v1/admin/lora", custom_routes.lora_load_handler(custom))
    app.router.add_delete("/v1/admin/lora/{name}", custom_routes.lora_unload_handler(custom))
    detector = detect.WatermarkDetector(gateway.config, lambda: gateway.layout)
    app.router.add_post("/v1/watermark/detect", detect.detect_handler(detector))
    if gateway.config.jobs.enabled:  # /v1/audio/jobs, and this process's job runner
        jobs.setup(app, gateway)
    if gateway.config.cache.enabled:  # the sentence audio cache's purges
        assert gateway.cache is not None
        app.router.add_routes(
            cache_routes.routes(gateway.cache, lambda key: [job_tenant(owner_of(key))])
        )
        warm.setup(app, gateway)  # POST /v1/cache/warm
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    if g.playground:
        app.router.add_get("/", playground)
    return app
