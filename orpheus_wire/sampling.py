"""The sampling fields a speech request may carry, over HTTP (``gateway.schemas.SpeechRequest``)
and ZeroMQ (``orpheus_wire.zeromq.Speak``): declared once, inherited by both."""

from __future__ import annotations

import msgspec


class SamplingFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Extensions to OpenAI's request (HTTP and ZeroMQ); their limits are
    ``common.limits``' (the llm_worker's), checked by ``gateway.schemas.build_params``."""

    max_tokens: int | None = None
    """Exact number of audio tokens (7 per 85 ms frame), at least 7, at most
    ``llm.max_tokens_cap``; None: the server caps the length by the text's."""
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
