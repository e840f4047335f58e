"""``POST /v1/watermark/detect``: does this audio carry the server's watermark?

A platform checks audio that claims to be human. The body is the audio file itself (any
container and codec FFmpeg reads; ``Content-Type`` is not trusted) or a multipart form with
the file in ``audio`` or ``file``, at most ``voices.max_upload_bytes`` (the custom voices'
bound) and ``MAX_SECONDS`` long, ``voices.max_concurrent_uploads`` at once per gateway process
(429 past it). The gateway decodes it to 24 kHz mono with PyAV on a thread (it never touches
torch) and asks the codec worker, which holds the watermark's network (``DetectRequest`` over
the ROUTER of custom voices' ``EncodeRequest``, ``layout.encode``).

The answer: ``{"object": "watermark.detection", "watermark": "perth", "score": 0.998,
"marked": true, "threshold": 0.5, "seconds": 3.07, "sample_rate": 8000}``. ``score`` is the
detector's confidence that the clip is marked; ``marked`` is ``score >= threshold`` (PerTh's
own reading rounds at 0.5).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from typing import IO, Any

import msgspec
import zmq.asyncio
from aiohttp import BodyPartReader, web

from common.config import ServeConfig
from gateway.audio.decode import UnreadableAudio, decode_clip
from gateway.errors import APIError
from gateway.rpc import Uploads, call_codec
from shm.layout import InstanceLayout
from shm.messages import DetectReply, DetectRequest, detect_reply_decoder

MAX_SECONDS = 120.0
"""The longest clip read (the codec worker's own bound too)."""
THRESHOLD = 0.5
_ids = itertools.count(1)


class Detection(msgspec.Struct, frozen=True):
    watermark: str
    score: float
    marked: bool
    threshold: float
    seconds: float
    sample_rate: int
    object: str = "watermark.detection"


class WatermarkDetector:
    """The route's state: the codec worker's socket and the uploads in progress."""

    def __init__(self, config: ServeConfig, layout: Callable[[], InstanceLayout]) -> None:
        self.config = config
        self.cfg = config.voices
        self._layout = layout
        """The instance's sockets, read at the first request (the app is built before)."""
        self.ctx = zmq.asyncio.Context.instance()
        self.uploads = Uploads(self.cfg.max_concurrent_uploads, config.gateway.retry_after_s)

    async def detect(self, audio: IO[bytes]) -> Detection:
        loop = asyncio.get_running_loop()
        try:
            pcm, rate = await loop.run_in_executor(None, decode_clip, audio, MAX_SECONDS)
        except UnreadableAudio as e:
            raise APIError(400, "invalid_audio", f"audio: {e}", param="audio") from None
        req = DetectRequest(next(_ids) | (os.getpid() << 32), pcm.astype("<f4").tobytes())
        raw = await call_codec(
            self.ctx,
            self._layout().encode,
            req,
            self.cfg.encode_timeout_s,
            doing="read the clip",
            retry_after_s=self.config.gateway.retry_after_s,
        )
        reply: DetectReply = detect_reply_decoder.decode(raw)
        if reply.error:
            raise APIError(500, "detect_failed", f"reading the watermark failed: {reply.error}")
        return Detection(
            watermark=reply.watermark,
            score=round(reply.score, 4),
            marked=reply.score >= THRESHOLD,
            threshold=THRESHOLD,
            seconds=round(len(pcm) / 24_000, 3),
            sample_rate=rate,
        )


async def _read_body(request: web.Request, max_bytes: int, out: IO[bytes]) -> None:
    """The audio file, from the raw body or a multipart form's ``audio``/``file`` part."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(413, "request_too_large", f"the body is over {max_bytes} bytes")
    total = 0

    async def copy(read: Any) -> None:
        nonlocal total
        while chunk := await read(64 * 1024):
            total += len(chunk)
            if total > max_bytes:
                raise APIError(413, "request_too_large", f"the body is over {max_bytes} bytes")
            out.write(chunk)

    if request.content_type.startswith("multipart/"):
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if isinstance(part, BodyPartReader) and part.name in ("audio", "file"):
                await copy(part.read_chunk)
                break
        else:
            raise APIError(
                400, "missing_audio", "audio: no file field (audio or file)", param="audio"
            )
    else:
        await copy(request.content.read)
    if not total:
        raise APIError(400, "missing_audio", "audio: the body is empty", param="audio")
    out.seek(0)


def detect_handler(detector: WatermarkDetector) -> Any:
    async def handler(request: web.Request) -> web.Response:
        cfg = detector.cfg
        with detector.uploads.spooled() as audio:
            await _read_body(request, cfg.max_upload_bytes, audio)
            result = await detector.detect(audio)
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")

    return handler
