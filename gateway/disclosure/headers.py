"""What every audio answer says about itself: that it is AI-generated, and how it is marked
(issue 58, part 4; the EU AI Act's article 50(2) asks for machine-readable marking).

HTTP answers of the audio routes (``app`` names them) carry, streamed or whole, from the
first byte (a WebSocket's on its upgrade):

- ``AI-Disclosure: mode=ai-originated``: the IETF draft's structured field
  (draft-abaris-aicdh), for crawlers and archives that read it;
- ``X-AI-Generated: true``;
- ``X-Watermark``: what marks the audio itself (``watermark_of``: ``perth``, or ``none``).

Protocols with a metadata message say the same in it (vLLM-Omni's ``audio.start``,
ZeroMQ's ``started``: ``ai_generated``, ``watermark``). ``watermark_of`` is the one place
they all take the watermark from.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Final

from aiohttp import web

from common.config import ServeConfig

AI_DISCLOSURE: Final = "AI-Disclosure"
AI_GENERATED: Final = "X-AI-Generated"
WATERMARK: Final = "X-Watermark"
NO_WATERMARK: Final = "none"


def watermark_of(config: ServeConfig) -> str:
    """The watermark the codec worker puts in every audio stream (``codec.watermark``, ``perth``
    by default), by name, or ``none`` where it is ``off``."""
    kind = config.codec.watermark
    return NO_WATERMARK if kind == "off" else kind


def disclosure_headers(config: ServeConfig) -> dict[str, str]:
    """The headers of every audio answer under ``config``."""
    return {
        AI_DISCLOSURE: "mode=ai-originated",
        AI_GENERATED: "true",
        WATERMARK: watermark_of(config),
    }


def mark_audio_answers(
    audio_paths: Iterable[str], config: ServeConfig
) -> Callable[[web.Request, web.StreamResponse], Awaitable[None]]:
    """``on_response_prepare``: the disclosure headers on every successful answer (a
    WebSocket's 101 included) of a route whose path is one of ``audio_paths``; errors and
    the other routes go as they were."""
    paths = frozenset(audio_paths)
    headers = disclosure_headers(config)

    async def mark(request: web.Request, response: web.StreamResponse) -> None:
        resource = request.match_info.route.resource
        if resource is not None and response.status < 300 and resource.canonical in paths:
            response.headers.update(headers)

    return mark
