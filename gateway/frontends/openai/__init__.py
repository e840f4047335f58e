"""OpenAI's ``POST /v1/audio/speech``: its body (``body``), chunked audio or SSE (``speech``, ``sse``)."""

from __future__ import annotations

from gateway.frontends.openai.speech import routes

__all__ = ["routes"]
