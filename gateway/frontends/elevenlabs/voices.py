"""ElevenLabs' voice and model listings: ``GET /v1/voices`` (the SDK's ``voices.get_all``),
``GET /v2/voices`` (``voices.search``: search, filters, pages), ``GET /v1/voices/{voice_id}``
(``voices.get``) and, for ElevenLabs clients, ``GET /v1/models`` (``models.list``).

Every voice a request may name is listed: the checkpoint's (category ``premade``), custom
voices made from reference audio (``cloned``) and LoRA voices (``professional``: a voice
fine-tuned on recordings, as ElevenLabs' professional clones are). Voices are the server's,
shared by every API key. Their languages come from ``Gateway.languages`` (``gateway.voices.languages``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from common.languages import language_name
from gateway.errors import APIError
from gateway.frontends.shared import Handler
from gateway.service import Gateway

V1_VOICES_PATH = "/v1/voices"
V2_VOICES_PATH = "/v2/voices"
VOICE_PATH = "/v1/voices/{voice_id}"
DEFAULT_PAGE_SIZE = 10
MAX_PAGE_SIZE = 100
"""``voices.search``'s ``page_size``: ElevenLabs' default and most."""
VOICE_TYPES = {
    "default": {"premade"},
    "personal": {"cloned", "professional"},
    "non-default": {"cloned", "professional"},
    "saved": {"cloned", "professional"},
    "non-community": {"cloned", "professional"},
    "workspace": set(),
    "community": set(),
}
"""``voice_type`` filter -> the categories it keeps (this server has no shared library)."""

_json = msgspec.json.Encoder()


class VerifiedLanguage(msgspec.Struct):
    language: str
    model_id: str


class Voice(msgspec.Struct):
    """A voice in ElevenLabs' shape (``elevenlabs.types.Voice``)."""

    voice_id: str
    name: str
    category: str
    labels: dict[str, str]
    description: str | None
    verified_languages: list[VerifiedLanguage]
    high_quality_base_model_ids: list[str]
    created_at_unix: int | None = None
    is_owner: bool = False
    is_legacy: bool = False
    preview_url: str | None = None
    available_for_tiers: list[str] = []
    samples: None = None
    settings: None = None


class VoicesV1(msgspec.Struct):
    voices: list[Voice]


class VoicesV2(msgspec.Struct):
    voices: list[Voice]
    has_more: bool
    total_count: int
    next_page_token: str | None


class Language(msgspec.Struct):
    language_id: str
    name: str


class Model(msgspec.Struct):
    """A model in ElevenLabs' shape (``elevenlabs.types.Model``)."""

    model_id: str
    name: str
    description: str
    languages: list[Language]
    can_do_text_to_speech: bool = True
    can_do_voice_conversion: bool = False
    can_be_finetuned: bool = False
    can_use_style: bool = False
    can_use_speaker_boost: bool = False
    serves_pro_voices: bool = True
    requires_alpha_access: bool = False
    token_cost_factor: float = 1.0
    max_characters_request_free_user: int = 0
    max_characters_request_subscribed_user: int = 0
    maximum_text_length_per_request: int = 0


def _json_response(body: msgspec.Struct) -> web.Response:
    return web.Response(body=_json.encode(body), content_type="application/json")


async def all_voices(gateway: Gateway) -> list[Voice]:
    """Every usable voice, built-in first, in ElevenLabs' shape (the custom voices are read
    from the state directory off the event loop)."""
    config = gateway.config
    model = config.llm.model
    listing = gateway.voices.listing
    loop = asyncio.get_running_loop()
    found = await loop.run_in_executor(
        None, gateway.custom_voices.listing, listing.aliases, listing.default
    )

    def voice(vid: str, name: str, category: str, description: str | None, **kw: object) -> Voice:
        langs = (gateway.languages.of_voice(vid),)
        return Voice(
            voice_id=vid, name=name, category=category,
            labels={"language": langs[0]} if langs else {}, description=description,
            verified_languages=[VerifiedLanguage(lang, model) for lang in langs],
            high_quality_base_model_ids=[model], **kw,  # type: ignore[arg-type]
        )  # fmt: skip

    return [
        *(voice(v, v, "premade", None) for v in found.builtin),
        *(
            voice(
                c.id,
                c.name,
                "cloned",
                c.description or None,
                created_at_unix=c.created_at,
                is_owner=True,
            )
            for c in found.custom
        ),
        *(
            voice(v.id, v.id, "professional", f"LoRA adapter {v.path}", is_owner=True)
            for v in found.lora
            if v.error is None
        ),
    ]


def _query_list(request: web.Request, name: str) -> list[str]:
    """A parameter the SDK may repeat (``language=en&language=fr``) or join with commas."""
    return [p.strip() for v in request.query.getall(name, []) for p in v.split(",") if p.strip()]


def _bad(param: str, message: str) -> APIError:
    return APIError(400, "invalid_request", f"{param}: {message}", param=param)


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise _bad(name, f"not an integer: {raw!r}") from None
    if not low <= value <= high:
        raise _bad(name, f"must be {low}..{high}, got {value}")
    return value


def _filters(request: web.Request) -> list[Callable[[Voice], bool]]:
    """``voices.search``'s filters this server can apply; a filter on a label its voices do
    not carry (gender, age, accent, use case) keeps none."""
    q = request.query
    keep: list[Callable[[Voice], bool]] = []
    if term := q.get("search", "").strip().lower():

        def matches(v: Voice) -> bool:
            fields = (v.voice_id, v.name, v.description or "", v.category, *v.labels.values())
            return any(term in f.lower() for f in fields)

        keep.append(matches)
    if voice_type := q.get("voice_type"):
        if voice_type not in VOICE_TYPES:
            raise _bad("voice_type", f"one of {', '.join(VOICE_TYPES)}")
        keep.append(lambda v: v.category in VOICE_TYPES[voice_type])
    if category := q.get("category"):
        keep.append(lambda v: v.category == category)
    if languages := set(_query_list(request, "language")):
        keep.append(lambda v: v.labels.get("language") in languages)
    if ids := set(_query_list(request, "voice_ids")):
        keep.append(lambda v: v.voice_id in ids)
    for label in ("gender", "age", "accent"):
        if value := q.get(label):
            keep.append(lambda v, k=label, x=value: v.labels.get(k) == x)
    if use_cases := set(_query_list(request, "use_cases")):
        keep.append(lambda v: v.labels.get("use_case") in use_cases)
    if q.get("high_quality", "").lower() == "true":
        keep.append(lambda v: v.category == "high_quality")
    return keep


def _sorted(request: web.Request, voices: list[Voice]) -> list[Voice]:
    sort = request.query.get("sort")
    direction = request.query.get("sort_direction", "asc" if sort == "name" else "desc")
    if direction not in ("asc", "desc"):
        raise _bad("sort_direction", "'asc' or 'desc'")
    if sort is None:
        return voices  # built-in, custom, LoRA: the listing's order
    if sort == "name":
        return sorted(voices, key=lambda v: v.name.lower(), reverse=direction == "desc")
    if sort == "created_at_unix":  # built-in voices (no creation time) last
        dated = sorted(
            (v for v in voices if v.created_at_unix is not None),
            key=lambda v: v.created_at_unix or 0,
            reverse=direction == "desc",
        )
        return dated + [v for v in voices if v.created_at_unix is None]
    raise _bad("sort", "'created_at_unix' or 'name'")


def routes(gateway: Gateway) -> list[web.RouteDef]:
    async def get_all(_: web.Request) -> web.Response:
        return _json_response(VoicesV1(await all_voices(gateway)))

    async def search(request: web.Request) -> web.Response:
        size = _int_param(request, "page_size", DEFAULT_PAGE_SIZE, 1, MAX_PAGE_SIZE)
        token = request.query.get("next_page_token") or "0"
        if not token.isdigit():
            raise _bad("next_page_token", "not a token this server gave")
        start = int(token)
        filters = _filters(request)
        voices = _sorted(
            request, [v for v in await all_voices(gateway) if all(f(v) for f in filters)]
        )
        page = voices[start : start + size]
        more = start + size < len(voices)
        return _json_response(
            VoicesV2(page, more, len(voices), str(start + size) if more else None)
        )

    async def get_one(request: web.Request) -> web.Response:
        vid = request.match_info["voice_id"]
        for v in await all_voices(gateway):
            if v.voice_id == vid or v.voice_id == vid.lower():
                return _json_response(v)
        raise APIError(404, "voice_not_found", f"no voice {vid!r}", param="voice_id")

    return [
        web.get(V1_VOICES_PATH, get_all),
        web.get(V2_VOICES_PATH, search),
        web.get(VOICE_PATH, get_one),
    ]


def asks_for_elevenlabs(request: web.Request) -> bool:
    """Whether ``GET /v1/models`` comes from an ElevenLabs client (its ``xi-api-key``, or the
    ElevenLabs SDKs' ``X-Fern-SDK-Name``): it expects a JSON array of ElevenLabs' models,
    OpenAI clients (``Authorization: Bearer``) a ``{"object": "list", "data"}``."""
    if "xi-api-key" in request.headers:
        return True
    return "elevenlabs" in request.headers.get("X-Fern-SDK-Name", "").lower()


def models_handler(gateway: Gateway) -> Handler:
    """``GET /v1/models`` for ElevenLabs clients: the served checkpoint, its languages (read
    at the first request: the route table is built before the gateway has its voices)."""
    body: bytes | None = None

    def encode() -> bytes:
        config = gateway.config
        limit = config.gateway.max_input_chars
        model = Model(
            model_id=config.llm.model,
            name=config.llm.model,
            description="Orpheus text-to-speech served by orpheus-serve; any model_id a "
            "request names is served by this model",
            languages=[Language(c, language_name(c)) for c in gateway.languages.all()],
            max_characters_request_free_user=limit,
            max_characters_request_subscribed_user=limit,
            maximum_text_length_per_request=limit,
        )
        return _json.encode([model])

    async def list_models(_: web.Request) -> web.Response:
        nonlocal body
        if body is None:
            body = encode()
        return web.Response(body=body, content_type="application/json")

    return list_models
