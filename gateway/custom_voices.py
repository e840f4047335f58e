"""Custom voices in the gateway: ``POST/GET /v1/audio/voices``, ``DELETE /v1/audio/voices/{id}``,
and the LoRA admin calls ``POST /v1/admin/lora``, ``DELETE /v1/admin/lora/{name}``.

A zero-shot voice is made here, in four steps:

1. the multipart form is read (``name``, ``audio`` (or ``audio_sample``), ``transcript``,
   optional ``description`` and ``language``: the voice's, ISO 639-1) within ``voices.max_upload_bytes``, the audio spooled (in
   memory up to ``SPOOL_MEMORY_BYTES``, then a temporary file); at most
   ``voices.max_concurrent_uploads`` at once per gateway process (429 past it);
2. the audio is decoded and resampled to 24 kHz mono float with PyAV (FFmpeg: any container
   and codec it reads), on a thread so that the event loop keeps streaming; its length
   (``voices.min_seconds`` .. ``voices.max_seconds``), rate and level are checked, and
   whether its codes (one frame per 2048 samples) leave room in ``llm.max_model_len``;
3. the codec worker encodes it with SNAC's encoder (``EncodeRequest`` over its ROUTER
   ``layout.encode``; the gateway never touches torch);
4. the codes and the transcript are stored in the state directory (:mod:`store.voices`),
   where every gateway and the llm_worker read them. The voice's id is its name in lower
   case; from then on it is a ``voice`` in every API.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import logging
import math
import os
import tempfile
from collections.abc import Callable
from typing import IO, Any

import av
import msgspec
import numpy as np
import zmq
import zmq.asyncio
from aiohttp import BodyPartReader, web

from common.config import ServeConfig
from common.languages import UnknownLanguage, language_tag
from common.voice_lookup import lora_unavailable, zero_shot_unsupported
from gateway.errors import APIError
from shm.layout import InstanceLayout
from shm.messages import (
    UNDECODABLE,
    AdminReply,
    EncodeReply,
    EncodeRequest,
    LoraLoad,
    LoraSync,
    LoraUnload,
    admin_reply_decoder,
    control_encoder,
    encode_reply_decoder,
)
from shm.records import CODE_DTYPE, FRAME_CODES
from store.lora import LORA_SUFFIX, LoraRegistry
from store.voices import (
    ID_RE,
    TooManyVoices,
    VoiceExists,
    VoicesConfig,
    VoiceStore,
    VoiceSummary,
    new_record,
    voice_id,
)

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 2048
MIN_INPUT_RATE = 16_000
"""Below this the clip cannot carry what SNAC's 24 kHz codes describe (8 kHz telephone
audio makes a muffled voice): refused as a wrong sample format."""
MAX_CHANNELS = 8
MAX_DESCRIPTION_CHARS = 500
PROMPT_OVERHEAD_TOKENS = 16
ADMIN_TIMEOUT_S = 120.0
MAX_FIELD_BYTES = 64 * 1024
"""Text fields longer than this are cut (their limits are far below: refused after)."""
SPOOL_MEMORY_BYTES = 1 << 20
"""An uploaded clip is held in memory up to this size, in a temporary file beyond."""
_ids = itertools.count(1)


class LoraListing(msgspec.Struct, frozen=True):
    id: str
    path: str
    speaker: str
    source: str
    """"config" ([llm] lora_voices) or "runtime" (the admin API)."""
    type: str = "lora"
    error: str | None = None
    """Why the llm_worker could not load this run-time voice when it started (requests for
    it are refused with 503 ``voice_unavailable``); None: the voice is usable."""


class VoiceListing(msgspec.Struct, frozen=True):
    """Body of ``GET /v1/audio/voices``."""

    voices: list[str]
    """Every voice a request may name: built-in, custom, LoRA (not one with an ``error``)."""
    aliases: dict[str, str]
    default: str
    builtin: list[str]
    custom: list[VoiceSummary]
    lora: list[LoraListing]
    zero_shot: bool
    """Whether the model takes custom voices made from reference audio."""


class CreatedVoice(VoiceSummary, frozen=True, kw_only=True):
    """Body of ``POST /v1/audio/voices`` (201): the voice as listed, with OpenAI's ``object``."""

    object: str = "audio.voice"


def _bad(code: str, message: str, param: str | None = None, status: int = 400) -> APIError:
    return APIError(status, code, message, param=param)


# -- audio ---------------------------------------------------------------------------------------


def decode_reference(data: bytes | IO[bytes], cfg: VoicesConfig) -> np.ndarray:
    """The clip (its bytes or a file) as float32 mono 24 kHz, checked; APIError 400 for what
    cannot be a voice."""
    try:
        container = av.open(io.BytesIO(data) if isinstance(data, bytes) else data, mode="r")
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise _bad(
            "invalid_audio", f"audio: not an audio file FFmpeg can read ({e})", "audio"
        ) from None
    limit = int((cfg.max_seconds + 0.5) * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    n = 0
    with container:
        if not container.streams.audio:
            raise _bad("invalid_audio", "audio: the file has no audio stream", "audio")
        stream = container.streams.audio[0]
        ctx = stream.codec_context
        rate = ctx.sample_rate or 0
        channels = ctx.channels or 0
        if rate < MIN_INPUT_RATE:
            raise _bad(
                "unsupported_sample_format",
                f"audio: sample rate {rate} Hz; at least {MIN_INPUT_RATE} Hz is needed",
                "audio",
            )
        if channels > MAX_CHANNELS:
            raise _bad(
                "unsupported_sample_format",
                f"audio: {channels} channels; at most {MAX_CHANNELS}",
                "audio",
            )
        resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    arr = out.to_ndarray().reshape(-1)
                    chunks.append(arr)
                    n += len(arr)
                if n > limit:
                    break
            else:
                for out in resampler.resample(None):
                    arr = out.to_ndarray().reshape(-1)
                    chunks.append(arr)
                    n += len(arr)
        except (av.error.FFmpegError, ValueError) as e:
            raise _bad("invalid_audio", f"audio: undecodable ({e})", "audio") from None
    seconds = n / SAMPLE_RATE
    if n > limit or seconds > cfg.max_seconds:
        raise _bad(
            "audio_too_long",
            f"audio: longer than {cfg.max_seconds:g} s; send a clip of "
            f"{cfg.min_seconds:g}-{cfg.max_seconds:g} s",
            "audio",
        )
    if seconds < cfg.min_seconds:
        raise _bad(
            "audio_too_short",
            f"audio: {seconds:.2f} s; send a clip of {cfg.min_seconds:g}-{cfg.max_seconds:g} s",
            "audio",
        )
    pcm = np.concatenate(chunks).astype(np.float32, copy=False)
    if not np.isfinite(pcm).all():
        raise _bad("invalid_audio", "audio: holds NaN or infinite samples", "audio")
    np.clip(pcm, -1.0, 1.0, out=pcm)
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))
    level = 20 * math.log10(rms) if rms > 0 else -math.inf
    if level < cfg.silence_dbfs:
        raise _bad(
            "audio_silent",
            f"audio: silent (level {level:.1f} dBFS, below {cfg.silence_dbfs:g})",
            "audio",
        )
    return pcm


# -- request/reply to the workers ----------------------------------------------------------------


async def _call(
    ctx: zmq.asyncio.Context, endpoint: str, msg: msgspec.Struct, timeout_s: float
) -> bytes | None:
    """One request on a fresh DEALER (these calls are rare); None on timeout."""
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


class CustomVoices:
    """What the HTTP handlers need: the store, the clients to the workers, the names taken."""

    def __init__(
        self,
        config: ServeConfig,
        layout: InstanceLayout,
        builtin: list[str],
        aliases: list[str],
        ready_engines: Callable[[], tuple[bool, ...]] | None = None,
    ) -> None:
        self.config = config
        self.ready_engines = ready_engines or (lambda: (True,) * layout.engines)
        """Which engines can take an admin request now (the gateway's cluster status)."""
        self.cfg = config.voices
        self.layout = layout
        self.store = VoiceStore(self.cfg.state_dir)
        self.loras = LoraRegistry(self.cfg.state_dir)
        self.builtin = list(builtin)
        self.reserved = {v.lower() for v in builtin} | {a.lower() for a in aliases}
        self.ctx = zmq.asyncio.Context.instance()
        self.uploads = 0
        """``POST /v1/audio/voices`` calls in progress in this process."""
        self._languages: dict[str, tuple[tuple[int, int], str | None]] = {}
        self._lora_languages: dict[str, tuple[tuple[int, int, int], str | None]] = {}
        """Custom voice -> (its file's stat key, its language): ``language_of``'s cache."""
        self._config_loras = frozenset(
            n.strip().lower() for n in config.llm.lora_voices if ID_RE.match(n.strip().lower())
        )

    @property
    def zero_shot(self) -> bool:
        return bool(self.config.llm.zero_shot)

    # The gateway's view of the voices ``common.voice_lookup.VoiceLookup`` asks about (before
    # admission, in the order the llm_worker asks its own): a stat or two, no file is read.
    def is_lora(self, vid: str) -> bool:
        """Whether ``vid`` is a LoRA voice: configured, or loaded at run time (its entry in
        the state directory, written by the llm_worker once the adapter is loaded). APIError
        503 ``voice_unavailable`` for a run-time voice the llm_worker could not load again
        when it started (its failure marker: the worker does not have it)."""
        if vid in self._config_loras:
            return True
        if not (self.config.llm.lora_enabled and self.loras.has(vid)):
            return False
        reason = self.loras.failure(vid)
        if reason is not None:
            raise APIError(503, "voice_unavailable", lora_unavailable(vid, reason), param="voice")
        return True

    def is_custom(self, vid: str) -> bool:
        """Whether ``vid`` is a custom (zero-shot) voice; APIError 400 (the llm_worker's
        message) for one while the model takes none."""
        if self.store.stat_key(vid) is None:
            return False
        if not self.zero_shot:
            raise APIError(400, "bad_request", zero_shot_unsupported(vid), param="voice")
        return True

    def version_of(self, vid: str) -> str:
        """The version of voice ``vid`` as the sentence audio cache keys it
        (``gateway.cache.keys``): a custom voice's file (inode, time), a LoRA voice's run-time
        entry (inode, time, size) or its configured adapter; "" for a voice of the model.
        Re-making or deleting a voice changes it, so its cached audio is never served again."""
        key = self.store.stat_key(vid)
        if key is not None:
            return f"custom:{key[0]}:{key[1]}"
        configured = self.config.llm.lora_voices.get(vid)
        if configured is not None:
            return f"lora-config:{configured.path}"
        if self.config.llm.lora_enabled:
            try:
                st = (self.loras.directory / f"{vid}{LORA_SUFFIX}").stat()
            except OSError:
                return ""
            return f"lora:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"
        return ""

    def language_of(self, vid: str) -> str | None:
        """The language a custom voice was made with (its form's ``language``), or a LoRA
        voice was loaded with at run time (``POST /v1/admin/lora``); None for one without,
        or no such voice. A stat or two per call; a file is read again only when it
        changed."""
        key = self.store.stat_key(vid)
        if key is None:
            self._languages.pop(vid, None)
            if self.config.llm.lora_enabled:
                return self.loras.language(vid, self._lora_languages)
            return None
        cached = self._languages.get(vid)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            record = self.store.get(vid)
        except (msgspec.DecodeError, OSError):
            return None
        language = record.language if record is not None else None
        if len(self._languages) >= 4096:
            self._languages.clear()
        self._languages[vid] = (key, language)
        return language

    def lora_listing(self) -> list[LoraListing]:
        out = {
            voice_id(name): LoraListing(voice_id(name), v.path, v.speaker or name, "config")
            for name, v in self.config.llm.lora_voices.items()
        }
        for e in self.loras.entries():
            if e.name not in out:
                error = self.loras.failure(e.name)
                out[e.name] = LoraListing(
                    e.name, e.path, e.speaker or e.name, "runtime", error=error
                )
        return sorted(out.values(), key=lambda v: v.id)

    def listing(self, aliases: dict[str, str], default: str) -> VoiceListing:
        custom = self.store.list()
        lora = self.lora_listing()
        return VoiceListing(
            voices=[
                *self.builtin,
                *(c.id for c in custom),
                *(v.id for v in lora if v.error is None),
            ],
            aliases=aliases,
            default=default,
            builtin=self.builtin,
            custom=custom,
            lora=lora,
            zero_shot=self.zero_shot,
        )

    async def encode(self, pcm: np.ndarray) -> np.ndarray:
        req = EncodeRequest(next(_ids) | (os.getpid() << 32), pcm.astype("<f4").tobytes())
        raw = await _call(self.ctx, self.layout.encode, req, self.cfg.encode_timeout_s)
        if raw is None:
            raise APIError(
                503,
                "codec_unavailable",
                f"the codec worker did not encode the clip within {self.cfg.encode_timeout_s:g} s",
                retry_after_s=self.config.gateway.retry_after_s,
            )
        reply: EncodeReply = encode_reply_decoder.decode(raw)
        if reply.error:
            raise APIError(500, "encode_failed", f"encoding the clip failed: {reply.error}")
        return np.frombuffer(reply.codes, dtype=CODE_DTYPE).reshape(-1, FRAME_CODES)

    async def admin(self, msg: LoraLoad | LoraUnload) -> AdminReply:
        """Load or unload a LoRA voice through one engine's worker (the first ready one), which
        writes or removes its registry entry; then the other ready engines follow the
        registry at once (``LoraSync``), so that the voice is usable on every engine, or on
        none, when this answers. An engine that is down follows it when it starts."""
        ready = [e for e, ok in enumerate(self.ready_engines()) if ok] or [0]
        reply = await self._admin_call(ready[0], msg)
        if reply.status == 200 and len(ready) > 1:
            synced = await asyncio.gather(
                *(self._admin_call(e, LoraSync(msg.request_id)) for e in ready[1:]),
                return_exceptions=True,
            )
            for e, r in zip(ready[1:], synced, strict=True):
                if isinstance(r, BaseException) or r.status != 200:
                    log.warning("engine %d did not follow the LoRA change of %r: %s", e, msg, r)
        return reply

    async def _admin_call(self, engine: int, msg: LoraLoad | LoraUnload | LoraSync) -> AdminReply:
        raw = await _call(self.ctx, self.layout.engine_admin(engine), msg, ADMIN_TIMEOUT_S)
        if raw is None:
            raise APIError(
                503, "upstream_unavailable", "the llm worker did not answer the admin request"
            )
        return admin_reply_decoder.decode(raw)


# -- handlers ------------------------------------------------------------------------------------


async def _read_form(
    request: web.Request, max_bytes: int, audio: IO[bytes]
) -> tuple[dict[str, str], bool]:
    """The text fields; the audio part is written to ``audio``. True: there was one."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise APIError(413, "request_too_large", f"the body is over {max_bytes} bytes")
    if not request.content_type.startswith("multipart/form-data"):
        raise _bad(
            "invalid_request",
            "send multipart/form-data with name, audio, transcript and optional description",
        )
    reader = await request.multipart()
    fields: dict[str, str] = {}
    has_audio = False
    total = 0
    while (part := await reader.next()) is not None:
        if not isinstance(part, BodyPartReader):
            raise _bad("invalid_request", "nested multipart bodies are not accepted")
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
                raise _bad("invalid_request", f"{name}: not UTF-8 text", name) from None
    if not has_audio:
        raise _bad("missing_audio", "audio: the reference clip (a file field) is missing", "audio")
    audio.seek(0)
    return fields, has_audio


def _check_context(voices: CustomVoices, frames: int, seconds: float, transcript: str) -> None:
    llm = voices.config.llm
    need = frames * 7 + len(transcript.encode()) + PROMPT_OVERHEAD_TOKENS + llm.min_max_tokens
    if need > llm.max_model_len:
        raise _bad(
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
        cfg = voices.cfg
        if not voices.zero_shot:
            raise _bad(
                "zero_shot_unsupported",
                f"the model {voices.config.llm.model!r} does not declare zero-shot voices "
                "(config.json 'orpheus.zero_shot'): custom voices from reference audio "
                "are not available with it",
            )
        if voices.uploads >= cfg.max_concurrent_uploads:
            raise APIError(
                429,
                "too_many_uploads",
                f"{cfg.max_concurrent_uploads} voice uploads are in progress on this gateway "
                "process (voices.max_concurrent_uploads); retry shortly",
                retry_after_s=voices.config.gateway.retry_after_s,
            )
        voices.uploads += 1
        try:
            with tempfile.SpooledTemporaryFile(SPOOL_MEMORY_BYTES) as audio:
                return await _create(request, voices, audio)
        finally:
            voices.uploads -= 1

    return handler


async def _create(request: web.Request, voices: CustomVoices, audio: IO[bytes]) -> web.Response:
    cfg = voices.cfg
    fields, _ = await _read_form(request, cfg.max_upload_bytes, audio)
    name = fields.get("name", "").strip()
    if not name:
        raise _bad("missing_name", "name: required", "name")
    try:
        vid = voice_id(name)
    except ValueError as e:
        raise _bad("invalid_name", f"name: {e}", "name") from None
    transcript = " ".join(fields.get("transcript", "").split())
    if not transcript:
        raise _bad(
            "empty_transcript",
            "transcript: required, the words spoken in the clip",
            "transcript",
        )
    if len(transcript) > cfg.max_transcript_chars or "\x00" in transcript:
        raise _bad(
            "invalid_transcript",
            f"transcript: at most {cfg.max_transcript_chars} characters, no NUL",
            "transcript",
        )
    description = fields.get("description", "").strip()
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise _bad(
            "invalid_description",
            f"description: at most {MAX_DESCRIPTION_CHARS} characters",
            "description",
        )
    language = None
    if fields.get("language", "").strip():
        try:
            language = language_tag(fields["language"])
        except UnknownLanguage as e:
            raise _bad("invalid_language", f"language: {e}", "language") from None
    if vid in voices.reserved or any(v.id == vid for v in voices.lora_listing()):
        raise _bad("voice_exists", f"name: {vid!r} is taken", "name", status=409)
    if voices.store.stat_key(vid) is not None:
        raise _bad("voice_exists", f"name: a custom voice {vid!r} exists", "name", status=409)
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
        raise _bad("voice_exists", f"name: a custom voice {vid!r} exists", "name", 409) from None
    except TooManyVoices:
        raise _bad(
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
            raise _bad("builtin_voice", f"{vid!r} is a built-in voice: it cannot be deleted")
        if any(v.id == vid for v in voices.lora_listing()):
            raise _bad(
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
    """The admin key itself is checked by the key middleware (``gateway.auth``)."""
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
    raise _bad(
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
            raise _bad("invalid_request", f"body: {e}") from None
        try:
            name = voice_id(body.name)
        except ValueError as e:
            raise _bad("invalid_name", f"name: {e}", "name") from None
        if name in voices.reserved or voices.store.stat_key(name) is not None:
            raise _bad("voice_exists", f"name: {name!r} is taken", "name", status=409)
        path = confined_lora_path(body.path, voices.config.gateway.lora_dirs)
        try:
            language = language_tag(body.language) if body.language else None
        except UnknownLanguage as e:
            raise _bad("invalid_language", f"language: {e}", "language") from None
        reply = await voices.admin(LoraLoad(next(_ids), name, path, body.speaker, language))
        return _admin_response(reply)

    return handler


def lora_unload_handler(voices: CustomVoices) -> Any:
    async def handler(request: web.Request) -> web.Response:
        _admin_allowed(voices)
        name = request.match_info["name"].strip().lower()
        return _admin_response(await voices.admin(LoraUnload(next(_ids), name)))

    return handler
