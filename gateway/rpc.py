"""Request/reply with a worker's ROUTER: the codec worker's (a clip to encode for a custom
voice, ``EncodeRequest``; a clip to read for the watermark, ``DetectRequest``) and an llm
worker's admin socket (LoRA voices). These calls are rare, so each is one request on a fresh
DEALER. The clips they carry arrive as uploads, spooled in memory up to
``SPOOL_MEMORY_BYTES`` and then in a temporary file."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from typing import IO

import msgspec
import zmq
import zmq.asyncio

from gateway.errors import APIError
from shm.messages import control_encoder

SPOOL_MEMORY_BYTES = 1 << 20


async def call_worker(
    ctx: zmq.asyncio.Context, endpoint: str, msg: msgspec.Struct, timeout_s: float
) -> bytes | None:
    """One request on a fresh DEALER; the reply's bytes, or None on timeout."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send(control_encoder.encode(msg))
        if await sock.poll(int(timeout_s * 1000)) == 0:
            return None
        return await sock.recv()
    finally:
        sock.close(linger=0)


async def call_codec(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    msg: msgspec.Struct,
    timeout_s: float,
    *,
    doing: str,
    retry_after_s: float,
) -> bytes:
    """One request to the codec worker's ROUTER; its reply's bytes, or a 503
    ``codec_unavailable`` that says it did not ``doing`` (``"encode the clip"``) in time."""
    raw = await call_worker(ctx, endpoint, msg, timeout_s)
    if raw is None:
        raise APIError(
            503,
            "codec_unavailable",
            f"the codec worker did not {doing} within {timeout_s:g} s",
            retry_after_s=retry_after_s,
        )
    return raw


class Uploads:
    """The clips a route is receiving in this process: at most ``limit`` at once (one more is
    429 ``too_many_uploads``, before its body is read), each spooled while it is handled."""

    def __init__(self, limit: int, retry_after_s: int, what: str = "uploads") -> None:
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.what = what
        self.in_progress = 0

    @contextlib.contextmanager
    def spooled(self) -> Iterator[IO[bytes]]:
        """One upload's slot and its spool (memory up to ``SPOOL_MEMORY_BYTES``, then a file)."""
        if self.in_progress >= self.limit:
            raise APIError(
                429,
                "too_many_uploads",
                f"{self.limit} {self.what} are in progress on this gateway process "
                "(voices.max_concurrent_uploads); retry shortly",
                retry_after_s=self.retry_after_s,
            )
        self.in_progress += 1
        try:
            with tempfile.SpooledTemporaryFile(SPOOL_MEMORY_BYTES) as spool:
                yield spool
        finally:
            self.in_progress -= 1
