"""How a request names the pronunciation dictionaries its text is read with: ElevenLabs'
``pronunciation_dictionary_locators`` item, the same field on every front end (the ZeroMQ
``Speak`` included). The dictionaries themselves and how they are applied are the gateway's
(``gateway.text``)."""

from __future__ import annotations

import msgspec


class Locator(msgspec.Struct, frozen=True, kw_only=True):
    """ElevenLabs' ``pronunciation_dictionary_locators`` item (other fields are ignored);
    the same field on every front end."""

    pronunciation_dictionary_id: str
    version_id: str | None = None
