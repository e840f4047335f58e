"""The gateway's front ends: one package per protocol, each owning its routes, its wire
types and its serving code: ``openai`` (OpenAI speech, HTTP and SSE), ``omni`` (vLLM-Omni's
streaming WebSocket), ``elevenlabs`` (WebSocket and HTTP), ``baseten`` (WebSocket and HTTP)
and ``zeromq`` (internal clients; it serves its own socket, not routes). What they share is
beside them: ``shared`` (bodies, errors, the streaming template, WebSocket JSON),
``utterance`` (units spoken in order), ``text_units``, ``alignment``.

``registry.HTTP_FRONTENDS`` is the registry ``gateway.app`` adds routes from; its docstring
lists every step of adding a protocol.
"""
