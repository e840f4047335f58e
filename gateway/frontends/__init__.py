"""The gateway's front ends: one package per protocol, each owning its routes, its wire
types and its serving code, on what they share (``shared``: bodies, errors, the streaming
template, WebSocket JSON; ``utterance``: units spoken in order; ``text_units``, ``alignment``).

``registry.HTTP_FRONTENDS`` is the registry ``gateway.app`` adds routes from: a protocol served over
HTTP or WebSocket is a package with ``routes(gateway) -> list[aiohttp.web.RouteDef]`` and
one line here. The ZeroMQ front end (``zeromq``) serves its own socket.
"""
