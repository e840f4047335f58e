"""The speak loop of ElevenLabs' HTTP text-to-speech and text-to-dialogue: a text's units
(sentences, as ``UnitSplitter`` cut them), one request each, in order, into one output."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from gateway.cache.control import USE, CacheUse
from gateway.frontends.alignment import UnitAligners
from gateway.frontends.text_units import Unit
from gateway.frontends.utterance import Deliver, speak_unit
from gateway.link import ClientLink
from gateway.schemas import SpeechParams
from gateway.service import Gateway


class UnitOutput(Protocol):
    """Where the units' audio goes: ``deliver`` takes it, aligned by the unit's ``aligners``."""

    aligners: UnitAligners

    @property
    def deliver(self) -> Deliver: ...


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
