"""ElevenLabs' API: text-to-speech over the multi-context WebSocket (``websocket``) and HTTP,
streamed and whole (``http``), pronunciation dictionaries (``dictionaries``), text-to-dialogue
(``dialogue``), the voice and model listings (``voices``); wire types in ``messages``; the
speak loop over a request's units that HTTP and dialogue share (``speak``)."""

from __future__ import annotations

from aiohttp import web

from gateway.frontends.elevenlabs import dialogue, dictionaries, http, messages, voices, websocket
from gateway.service import Gateway


def routes(gateway: Gateway) -> list[web.RouteDef]:
    return [
        web.get(messages.WS_PATH, websocket.multi_stream_handler(gateway)),
        web.get(messages.WS_SINGLE_PATH, websocket.multi_stream_handler(gateway, single=True)),
        web.post(messages.STREAM_PATH, http.stream_handler(gateway, timestamps=False)),
        web.post(messages.TIMESTAMPS_PATH, http.stream_handler(gateway, timestamps=True)),
        web.post(messages.CONVERT_PATH, http.stream_handler(gateway, timestamps=False, whole=True)),
        web.post(
            messages.CONVERT_TIMESTAMPS_PATH,
            http.stream_handler(gateway, timestamps=True, whole=True),
        ),
        *dictionaries.routes(gateway),
        *dialogue.routes(gateway),
        *voices.routes(gateway),
    ]


asks_for_models = voices.asks_for_elevenlabs
models_handler = voices.models_handler
