"""Speech clients the load generator drives: HTTP (aiohttp) and the gateway's ZeroMQ protocol.

A client fills a ``StreamTrace``: the actual send time, the status, the arrival time and
size of every piece of audio, how the request ended. It never decides what counts: the
summary does that from the trace.
"""

from __future__ import annotations

import contextlib
import time
from types import TracebackType
from typing import Any, Protocol, Self

import aiohttp
import msgspec

from bench.load.trace import Outcome, StreamTrace


class SpeechRequest(msgspec.Struct, frozen=True, kw_only=True):
    text: str
    voice: str = "tara"
    model: str = "tts-1"
    max_tokens: int | None = None
    """Fixes the output length (servers with random weights rarely stop by themselves)."""

    def http_body(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "input": self.text,
            "voice": self.voice,
            "response_format": "pcm",
            "stream_format": "audio",
            "speed": 1.0,
        }
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        return body


NO_STORE = {"Cache-Control": "no-store"}
"""The header a bench that measures synthesis sends with every request: the server's
sentence audio cache (on by default) would otherwise answer its repeated texts."""


class SpeechClient(Protocol):
    """Streams one request's audio into its trace. Cancellation must abort the request."""

    async def stream(self, request: SpeechRequest, trace: StreamTrace) -> None: ...

    async def aclose(self) -> None: ...


class HttpSpeechClient:
    """``POST /v1/audio/speech`` with ``response_format=pcm`` (24 kHz int16 mono, no header).
    ``use_cache`` False (the default): every request sends ``Cache-Control: no-store``, so
    that a repeated text is synthesised again, not answered by the sentence audio cache."""

    def __init__(
        self, base_url: str, *, read_timeout_s: float, api_key: str | None, use_cache: bool = False
    ) -> None:
        self._url = base_url.rstrip("/") + "/v1/audio/speech"
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if not use_cache:
            self._headers.update(NO_STORE)
        # One connection per stream and no pool limit: the generator, not the connector,
        # decides how many requests are in flight.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=read_timeout_s),
        )

    async def stream(self, request: SpeechRequest, trace: StreamTrace) -> None:
        trace.sent = time.perf_counter()
        try:
            async with self._session.post(
                self._url, json=request.http_body(), headers=self._headers
            ) as resp:
                trace.status = resp.status
                if resp.status != 200:
                    with contextlib.suppress(ValueError):
                        trace.retry_after_s = float(resp.headers.get("Retry-After", ""))
                    trace.error = (await resp.text())[:300]
                    trace.outcome = Outcome.HTTP_ERROR
                    return
                async for data in resp.content.iter_any():
                    trace.record(time.perf_counter(), len(data))
            trace.outcome = Outcome.OK
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            trace.error = f"{type(exc).__name__}: {exc}"[:300]
            trace.outcome = Outcome.BROKEN
        finally:
            trace.done = time.perf_counter()

    async def aclose(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()


class ZmqSpeechClient:
    """The gateway's ZeroMQ protocol (``orpheus_client.zmq_client.AsyncClient``), for internal clients.

    All streams share one DEALER socket, as an internal client would use it. ``use_cache``
    False (the default): every request sends ``cache="no-store"``, as HTTP's header.
    """

    def __init__(
        self, endpoint: str, *, read_timeout_s: float, api_key: str | None, use_cache: bool = False
    ) -> None:
        from orpheus_client.zmq_client import AsyncClient  # imported lazily: optional transport

        self._client = AsyncClient(endpoint, api_key=api_key, timeout_s=read_timeout_s)
        self._cache = None if use_cache else "no-store"

    async def stream(self, request: SpeechRequest, trace: StreamTrace) -> None:
        from orpheus_client.zmq_client import SpeechError

        self._client.open()  # idempotent; needs the running loop
        trace.sent = time.perf_counter()
        try:
            async for data in self._client.speech(
                request.text, voice=request.voice, max_tokens=request.max_tokens, cache=self._cache
            ):
                if data:
                    trace.record(time.perf_counter(), len(data))
            trace.status = 200
            trace.outcome = Outcome.OK
        except SpeechError as exc:
            trace.status = exc.status
            trace.error = str(exc)[:300]
            trace.outcome = Outcome.HTTP_ERROR
        except TimeoutError as exc:
            trace.error = f"TimeoutError: {exc}"[:300]
            trace.outcome = Outcome.BROKEN
        finally:
            trace.done = time.perf_counter()

    async def aclose(self) -> None:
        await self._client.aclose()
