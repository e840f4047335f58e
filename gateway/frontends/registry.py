"""The front ends served over HTTP and WebSocket, in the order their routes are added.

Adding a protocol, every step it takes (tests/docs/test_architecture.py fails on a step left out
where the code can tell):

1. A package ``gateway.frontends.<name>`` with ``routes(gateway) -> list[web.RouteDef]``.
   Its wire types are msgspec Structs with plain types; their values go through
   ``gateway.schemas.build_params`` (every field rule, the same 400s as every protocol).
   Each connection has one ``ClientLink`` (``gateway.links.open``, ``gateway.link``), and
   every write to its client goes through its ``write`` (naming the units whose audio it
   carries); each utterance is a request of ``gateway.requests`` on that link
   (``RequestTracker.open``); a streaming protocol speaks its units on a ``Lane`` with
   ``speak_unit`` (``gateway.frontends.utterance``). It never imports ``gateway.metrics``
   (.importlinter's ``frontends-no-metrics``).
2. One line in ``HTTP_FRONTENDS`` below (a protocol on its own socket is started by
   ``gateway.main`` instead, as ``zeromq`` is).
3. Its ``api`` label: a member of ``gateway.apis.Api`` (a new value: the exported values
   of the others stay as they are, dashboards and alerts select on them).
4. The package in the ``frontends-independent`` contract of ``.importlinter`` (front ends
   import none of each other; what two share moves to ``shared`` or ``utterance``).
5. Tests: a file of its own against the synthetic backend (``tests/harness/gateway_harness.py``,
   as ``tests/gateway/frontends/baseten/test_baseten.py``), with the protocol's real client package where one
   exists; its routes in ``ROUTES`` of ``tests/docs/test_architecture.py``; a streaming protocol
   in ``bench protocols`` (``bench/gateway/protocols.py``).
6. Docs: its section in docs/api.md, its row in README's API table and in the front ends'
   table of docs/architecture.md.
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
