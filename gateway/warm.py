"""``POST /v1/cache/warm``: fill the sentence audio cache ahead of the calls that need it
(the greetings, the hold message), at the lowest priority.

The body: ``input`` (a list of phrases), ``voice``, ``language``, the text's normalisation
and dictionaries, and the sampling fields, as a speech request's. Each phrase is rewritten
as a request's text is (``SpeechParams.spoken``), cut into its sentences (each a unit, as a
streaming protocol or a longer HTTP text would look it up) and queued in this gateway
process; the answer, 202 ``{"units": N}``, comes at once. A unit already cached is skipped;
each other one is synthesised only when the node has room beyond the interactive reserve and
nobody waits (``gateway.admission.readiness.background_room``, the long-form jobs' rule), one at a
time, and stored at once (no second sight), under the caller's key (or the node's scope).
Its stream is labelled ``api="jobs"`` in the metrics (background work in spare capacity).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import msgspec
from aiohttp import web

from gateway.admission.readiness import background_room
from gateway.apis import Api
from gateway.cache.control import NO_CACHE
from gateway.cache.units import sentences
from gateway.edge.auth import presented_key
from gateway.errors import APIError
from gateway.frontends.shared import read_body
from gateway.schemas import SpeechParams, build_params, sampling_overrides
from gateway.service import Gateway
from gateway.streams import StreamFailed
from orpheus_wire.sampling import SamplingFields
from orpheus_wire.text import Locator

log = logging.getLogger(__name__)

PATH = "/v1/cache/warm"
MAX_PHRASES = 100
"""Phrases one call may bring."""
MAX_QUEUED_UNITS = 1000
"""Units a gateway process keeps waiting to be warmed; a call past it is answered 429."""
ROOM_POLL_S = 0.25


class WarmBody(SamplingFields, frozen=True, kw_only=True, forbid_unknown_fields=True):
    input: list[str]
    voice: str | None = None
    language: str | None = None
    apply_text_normalization: str | None = None
    pronunciation_dictionary_locators: list[Locator] | None = None


class WarmAccepted(msgspec.Struct, frozen=True):
    units: int
    """Units queued to be warmed (those already cached are skipped when their turn comes)."""


_decoder = msgspec.json.Decoder(WarmBody)


class Warmer:
    """This process's queue of units to warm, and the task that speaks them in turn."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.queue: deque[tuple[SpeechParams, str]] = deque()
        self._task: asyncio.Task[None] | None = None

    def add(self, units: list[SpeechParams], tenant: str) -> None:
        if len(self.queue) + len(units) > MAX_QUEUED_UNITS:
            raise APIError(
                429,
                "warm_queue_full",
                f"this gateway process has {len(self.queue)} units waiting to be warmed "
                f"(at most {MAX_QUEUED_UNITS}); send the rest later",
            )
        self.queue.extend((u, tenant) for u in units)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="cache-warm")

    async def _run(self) -> None:
        gateway = self.gateway
        cache = gateway.cache
        assert cache is not None
        reserve = gateway.config.jobs.reserve_streams
        while self.queue:
            params, tenant = self.queue[0]
            key = cache.key(tenant, params.text, params.voice, params.sampling)
            if await cache.lookup(key) is None:
                while not background_room(gateway.admission, reserve, gateway.draining)[0]:
                    if gateway.draining:
                        self.queue.clear()
                        return
                    await asyncio.sleep(ROOM_POLL_S)
                await self._speak(params, tenant)
            self.queue.popleft()

    async def _speak(self, params: SpeechParams, tenant: str) -> None:
        gateway = self.gateway
        try:
            with gateway.links.open(Api.JOBS) as link:
                async with gateway.requests.open(
                    params, link, cache=NO_CACHE, cache_tenant=tenant
                ) as request:
                    while chunks := await request.stream.next_chunks():
                        link.wrote(sum(map(len, chunks)), request)
                    request.complete()
        except (APIError, StreamFailed) as e:
            log.info("cache warm-up: %r not warmed (%s)", params.text[:60], e)

    async def close(self) -> None:
        self.queue.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def setup(app: web.Application, gateway: Gateway) -> Warmer:
    """Add ``POST /v1/cache/warm`` to ``app``; its warmer stops with the app."""
    warmer = Warmer(gateway)
    g = gateway.config.gateway

    async def warm(request: web.Request) -> web.Response:
        try:
            body = _decoder.decode(await read_body(request, g.max_body_bytes))
        except msgspec.DecodeError as e:
            raise APIError(400, "invalid_request", f"invalid body: {e}") from None
        if not 1 <= len(body.input) <= MAX_PHRASES:
            raise APIError(
                400,
                "invalid_request",
                f"input must hold 1 to {MAX_PHRASES} phrases",
                param="input",
            )
        key = presented_key(request)
        language = gateway.languages.resolve(body.language, body.voice)
        plan = await gateway.speech_text.plan(
            body.pronunciation_dictionary_locators, body.apply_text_normalization, key, language
        )
        units: list[SpeechParams] = []
        for phrase in body.input:
            params = build_params(
                gateway.voices, gateway.limits, text=phrase, voice=body.voice,
                max_chars=g.max_input_chars, sampling=sampling_overrides(body), text_plan=plan,
            ).spoken()  # fmt: skip
            units += (msgspec.structs.replace(params, text=s) for s in sentences(params.text))
        warmer.add(units, key)
        return web.Response(
            status=202,
            body=msgspec.json.encode(WarmAccepted(len(units))),
            content_type="application/json",
        )

    async def on_cleanup(_: web.Application) -> None:
        await warmer.close()

    app.on_cleanup.append(on_cleanup)
    app.router.add_post(PATH, warm)
    return warmer
