"""vLLM-Omni's streaming speech WebSocket (``speech_stream``; wire types in ``messages``,
the units a client is shown in ``units``)."""

from __future__ import annotations

from gateway.frontends.omni.speech_stream import routes

__all__ = ["routes"]
