"""The custom voices' routes: ``POST/GET /v1/audio/voices`` (the form read, the clip checked
and encoded, the voice stored: the steps ``gateway.voices.custom`` describes),
``DELETE /v1/audio/voices/{id}``, and the LoRA admin calls ``POST /v1/admin/lora``,
``DELETE /v1/admin/lora/{name}``. The state they act on is ``custom.CustomVoices``."""

from __future__ import annotations

import asyncio
import logging
import math
import os
from typing import IO, Any

import msgspec
from aiohttp import BodyPartReader, web

from common.languages import UnknownLanguage, language_tag
from gateway.errors import APIError
from gateway.voices.custom import (
    SAMPLE_RATE,
    SAMPLES_PER_FRAME,
    CreatedVoice,
    CustomVoices,
    bad_field,
    decode_reference,
    next_request_id,
)
from shm.messages import (
    UNDECODABLE,
    AdminReply,
    LoraLoad,
    LoraUnload,
)
from store.voices import (
    TooManyVoices,
    VoiceExists,
    new_record,
    voice_id,
)

log = logging.getLogger(__name__)

MAX_DESCRIPTION_CHARS = 500
PROMPT_OVERHEAD_TOKENS = 16
"""The prompt's tokens besides the reference's codes and transcript."""
MAX_FIELD_BYTES = 64 * 1024
"""Text fields longer than this are cut (their limits are far below: refused after)."""


async def _read_form(
    request: web.Request, max_bytes: int, audio: IO[bytes]
) -> tuple[dict[str, str], bool]:
    """The text fields; the audio part is written to ``audio``. True: there was one."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(413, "request_too_large", f"the body is over {max_bytes} bytes")
    if not request.content_type.startswith("multipart/form-data"):
        raise bad_field(
            "invalid_request",
            "send multipart/form-data with name, audio, transcript and optional description",
        )
    reader = await request.multipart()
    fields: dict[str, str] = {}
    has_audio = False
    total = 0
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise bad_field("invalid_request", "nested multipart bodies are not accepted")
        name = part.name or ""
        is_audio = name in ("audio", "audio_sample", "file")
        if is_audio:
            audio.seek(0)
            audio.truncate()
        buf = bytearray()
        while chunk := await part.read_chunk(64 * 1024):
            total += len(chunk)
            if total > max_bytes:
                raise APIError(413, "request_too_large", f"the body is over {max_bytes} bytes")
            if is_audio:
                audio.write(chunk)
                has_audio = True
            elif len(buf) <= MAX_FIELD_BYTES:
                buf += chunk
        if is_audio:
            continue
        if name in ("name", "transcript", "description", "language"):
            try:
                fields[name] = buf.decode("utf-8")
            except UnicodeDecodeError:
                raise bad_field("invalid_request", f"{name}: not UTF-8 text", name) from None
    if not has_audio:
        raise bad_field(
            "missing_audio", "audio: the reference clip (a file field) is missing", "audio"
        )
    audio.seek(0)
    return fields, has_audio


def _check_context(voices: CustomVoices, frames: int, seconds: float, transcript: str) -> None:
    llm = voices.config.llm
    need = frames * 7 + len(transcript.encode()) + PROMPT_OVERHEAD_TOKENS + llm.min_max_tokens
    if need > llm.max_model_len:
        raise bad_field(
            "audio_too_long",
            f"audio: {seconds:.1f} s of reference ({frames * 7} tokens) leaves too "
            f"little room for speech within llm.max_model_len {llm.max_model_len}; "
            "send a shorter clip",
            "audio",
        )


def create_handler(
    voices: CustomVoices,
) -> Any:
    async def handler(request: web.Request) -> web.Response:
        if not voices.zero_shot:
            raise bad_field(
                "zero_shot_unsupported",
                f"the model {voices.config.llm.model!r} does not declare zero-shot voices "
                "(config.json 'orpheus.zero_shot'): custom voices from reference audio "
                "are not available with it",
            )
        with voices.uploads.spooled() as audio:
            return await _create(request, voices, audio)

    return handler


async def _create(request: web.Request, voices: CustomVoices, audio: IO[bytes]) -> web.Response:
    cfg = voices.cfg
    fields, _ = await _read_form(request, cfg.max_upload_bytes, audio)
    name = fields.get("name", "").strip()
    if not name:
        raise bad_field("missing_name", "name: required", "name")
    try:
        vid = voice_id(name)
    except ValueError as e:
        raise bad_field("invalid_name", f"name: {e}", "name") from None
    transcript = " ".join(fields.get("transcript", "").split())
    if not transcript:
        raise bad_field(
            "empty_transcript",
            "transcript: required, the words spoken in the clip",
            "transcript",
        )
    if len(transcript) > cfg.max_transcript_chars or "\x00" in transcript:
        raise bad_field(
            "invalid_transcript",
            f"transcript: at most {cfg.max_transcript_chars} characters, no NUL",
            "transcript",
        )
    description = fields.get("description", "").strip()
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise bad_field(
            "invalid_description",
            f"description: at most {MAX_DESCRIPTION_CHARS} characters",
            "description",
        )
    language = None
    if fields.get("language", "").strip():
        try:
            language = language_tag(fields["language"])
        except UnknownLanguage as e:
            raise bad_field("invalid_language", f"language: {e}", "language") from None
    if vid in voices.reserved or any(v.id == vid for v in voices.lora_listing()):
        raise bad_field("voice_exists", f"name: {vid!r} is taken", "name", status=409)
    if voices.store.stat_key(vid) is not None:
        raise bad_field("voice_exists", f"name: a custom voice {vid!r} exists", "name", status=409)
    loop = asyncio.get_running_loop()
    pcm = await loop.run_in_executor(None, decode_reference, audio, cfg)
    seconds = len(pcm) / SAMPLE_RATE
    # Its length is known from the sample count (one frame per 2048 samples, the last
    # padded): a clip too long for the context is refused before it is encoded.
    _check_context(voices, math.ceil(len(pcm) / SAMPLES_PER_FRAME), seconds, transcript)
    frames = await voices.encode(pcm)
    _check_context(voices, len(frames), seconds, transcript)
    record = new_record(vid, name, transcript, description, frames, seconds, language)
    try:
        await loop.run_in_executor(None, voices.store.create, record, cfg.max_voices)
    except VoiceExists:
        raise bad_field(
            "voice_exists", f"name: a custom voice {vid!r} exists", "name", 409
        ) from None
    except TooManyVoices:
        raise bad_field(
            "too_many_voices",
            f"the server holds its limit of {cfg.max_voices} custom voices; delete one first",
            status=409,
        ) from None
    body = CreatedVoice(
        id=vid,
        name=name,
        description=description,
        created_at=record.created_at,
        duration_s=record.duration_s,
        frames=record.frames,
        language=language,
    )
    return web.Response(body=msgspec.json.encode(body), status=201, content_type="application/json")


def delete_handler(voices: CustomVoices) -> Any:
    async def handler(request: web.Request) -> web.Response:
        vid = request.match_info["voice_id"].strip().lower()
        if vid in voices.reserved:
            raise bad_field("builtin_voice", f"{vid!r} is a built-in voice: it cannot be deleted")
        if any(v.id == vid for v in voices.lora_listing()):
            raise bad_field(
                "lora_voice", f"{vid!r} is a LoRA voice: unload it with DELETE /v1/admin/lora/{vid}"
            )
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, voices.store.delete, vid):
            raise APIError(404, "voice_not_found", f"no custom voice {vid!r}", param="voice_id")
        return web.Response(
            body=msgspec.json.encode({"id": vid, "object": "audio.voice.deleted", "deleted": True}),
            content_type="application/json",
        )

    return handler


class LoraLoadBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    path: str
    speaker: str | None = None
    language: str | None = None


def _admin_allowed(voices: CustomVoices) -> None:
    """The admin key itself is checked by the key middleware (``gateway.edge.auth``)."""
    if not voices.config.gateway.admin_keys:
        raise APIError(
            403,
            "admin_disabled",
            "admin calls are off: set gateway.admin_keys (speech keys do not open them)",
        )


def confined_lora_path(path: str, dirs: list[str]) -> str:
    """``path`` with symbolic links and ``..`` resolved, if it lies in one of ``dirs``;
    APIError 400 ``lora_path_not_allowed`` if not (a Hugging Face name included)."""
    if dirs and os.path.isabs(os.path.expanduser(path)):
        real = os.path.realpath(os.path.expanduser(path))
        for d in dirs:
            root = os.path.realpath(os.path.expanduser(d))
            if os.path.commonpath([real, root]) == root:
                return real
    where = ", ".join(dirs) if dirs else "none configured"
    raise bad_field(
        "lora_path_not_allowed",
        f"path: adapters are loaded only from gateway.lora_dirs ({where}); got {path!r}",
        "path",
    )


def _admin_response(reply: AdminReply) -> web.Response:
    if reply.status != 200:
        raise APIError(reply.status, reply.code or "admin_error", reply.message)
    return web.Response(
        body=msgspec.json.encode({"id": reply.message, "object": "lora.voice", "ok": True}),
        content_type="application/json",
    )


def lora_load_handler(voices: CustomVoices) -> Any:
    async def handler(request: web.Request) -> web.Response:
        _admin_allowed(voices)
        try:
            body = msgspec.json.decode(await request.read(), type=LoraLoadBody)
        except UNDECODABLE as e:
            raise bad_field("invalid_request", f"body: {e}") from None
        try:
            name = voice_id(body.name)
        except ValueError as e:
            raise bad_field("invalid_name", f"name: {e}", "name") from None
        if name in voices.reserved or voices.store.stat_key(name) is not None:
            raise bad_field("voice_exists", f"name: {name!r} is taken", "name", status=409)
        path = confined_lora_path(body.path, voices.config.gateway.lora_dirs)
        try:
            language = language_tag(body.language) if body.language else None
        except UnknownLanguage as e:
            raise bad_field("invalid_language", f"language: {e}", "language") from None
        reply = await voices.admin(LoraLoad(next_request_id(), name, path, body.speaker, language))
        return _admin_response(reply)

    return handler


def lora_unload_handler(voices: CustomVoices) -> Any:
    async def handler(request: web.Request) -> web.Response:
        _admin_allowed(voices)
        name = request.match_info["name"].strip().lower()
        return _admin_response(await voices.admin(LoraUnload(next_request_id(), name)))

    return handler
