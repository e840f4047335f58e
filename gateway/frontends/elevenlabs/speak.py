"""The speak loop of ElevenLabs' HTTP text-to-speech and text-to-dialogue: a text's units
(sentences, as ``UnitSplitter`` cut them), one request each, in order, into one output; and
the end both answers share (finished whole, refused before any audio, or cut after it)."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Protocol

import msgspec
from aiohttp import web

from gateway.cache.control import USE, CacheUse
from gateway.errors import APIError
from gateway.frontends.alignment import UnitAligners
from gateway.frontends.shared import api_error
from gateway.frontends.text_units import Unit
from gateway.frontends.utterance import Deliver, speak_unit
from gateway.link import ClientLink
from gateway.schemas import SpeechParams
from gateway.service import Gateway
from gateway.streams import StreamFailed


class UnitOutput(Protocol):
    """Where the units' audio goes: ``deliver`` takes it, aligned by the unit's ``aligners``."""

    aligners: UnitAligners

    @property
    def deliver(self) -> Deliver: ...


class StreamedAnswer(Protocol):
    """An answer written as its audio comes: its link, its response (``None`` until the
    first bytes go out) and ``finish``, which ends it once all of it is spoken."""

    link: ClientLink
    resp: web.StreamResponse | None

    async def finish(self) -> web.StreamResponse: ...


async def speak_units(
    gateway: Gateway,
    template: SpeechParams,
    units: Sequence[Unit],
    link: ClientLink,
    out: UnitOutput,
    *,
    started_at: float | None,
    cache: CacheUse = USE,
) -> None:
    """Speak ``units`` with ``template``'s voice and settings, setting ``out.aligners`` to
    each unit's before its audio. The first unit's time to first byte counts from
    ``started_at`` (the request's arrival; ``None`` when audio went out before); the
    others' from the moment they could start (the end of the one before)."""
    for unit in units:
        spoken = msgspec.structs.replace(template, text=unit.text).spoken()
        out.aligners = UnitAligners(unit.raw, spoken.text, unit.pause_ms)
        await speak_unit(
            gateway, spoken, spoken.text, link, out.deliver,
            started_at=started_at, pause_ms=unit.pause_ms, cache=cache,
        )  # fmt: skip
        started_at = None


async def answered(out: StreamedAnswer, speaking: Awaitable[None]) -> web.StreamResponse:
    """``out`` once ``speaking`` (its units' audio) is done and ``out`` finished. A refusal or
    a failed stream before any audio went out is the request's error (JSON, with its status);
    after it, the connection is cut and the response ends where it was."""
    try:
        await speaking
        return await out.finish()
    except (APIError, StreamFailed) as e:
        if out.resp is None:
            raise api_error(e) from None
        out.link.abort()  # never let a cut stream pass for a whole one
        return out.resp
