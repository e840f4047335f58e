"""Baseten's Orpheus front end: the WebSocket (``websocket``) and the HTTP mode
(``predict``) that LiveKit's Baseten plugin speaks."""

from __future__ import annotations

from aiohttp import web

from gateway.frontends.baseten import predict, websocket
from gateway.service import Gateway


def routes(gateway: Gateway) -> list[web.RouteDef]:
    return [
        web.get(websocket.PATH, websocket.websocket_handler(gateway)),
        web.post(predict.PATH, predict.predict_handler(gateway)),
    ]
