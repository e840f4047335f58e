"""The front ends served over HTTP and WebSocket, in the order their routes are added.

A sixth protocol is one new package under ``gateway.frontends`` with a ``routes(gateway)``
function, and one line here.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp import web

from gateway.frontends import baseten, elevenlabs, omni, openai
from gateway.service import Gateway


class Frontend(Protocol):
    """A protocol's package: its routes, on the gateway that serves them."""

    def routes(self, gateway: Gateway) -> list[web.RouteDef]: ...


HTTP_FRONTENDS: tuple[Frontend, ...] = (
    openai,  # POST /v1/audio/speech
    omni,  # GET /v1/audio/speech/stream (WebSocket)
    baseten,  # /v1/baseten/orpheus/websocket, /v1/baseten/orpheus/predict
    elevenlabs,  # /v1/text-to-speech/{voice_id}/...
)
