"""Custom voices in the gateway, their state (``CustomVoices``: the store, the LoRA registry,
the listing, the calls to the workers); their routes are ``custom_routes``.

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
from collections.abc import Callable
from typing import IO

import av
import msgspec
import numpy as np
import zmq
import zmq.asyncio

from common.config import ServeConfig
from common.voice_lookup import lora_unavailable, zero_shot_unsupported
from gateway.errors import APIError
from gateway.rpc import Uploads, call_codec, call_worker
from shm.layout import InstanceLayout
from shm.messages import (
    AdminReply,
    EncodeReply,
    EncodeRequest,
    LoraLoad,
    LoraSync,
    LoraUnload,
    admin_reply_decoder,
    encode_reply_decoder,
)
from shm.records import CODE_DTYPE, FRAME_CODES
from store.lora import LORA_SUFFIX, LoraRegistry
from store.voices import (
    ID_RE,
    VoicesConfig,
    VoiceStore,
    VoiceSummary,
    voice_id,
)

log = logging.getLogger(__name__)

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 2048
MIN_INPUT_RATE = 16_000
"""Below this the clip cannot carry what SNAC's 24 kHz codes describe (8 kHz telephone
audio makes a muffled voice): refused as a wrong sample format."""
MAX_CHANNELS = 8
ADMIN_TIMEOUT_S = 120.0
_ids = itertools.count(1)


def next_request_id() -> int:
    """The next id of a request to a worker from this process (the codec worker's are made
    unique among gateways with the pid in the high bits)."""
    return next(_ids)


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


def bad_field(code: str, message: str, param: str | None = None, status: int = 400) -> APIError:
    return APIError(status, code, message, param=param)


# -- audio ---------------------------------------------------------------------------------------


def decode_reference(data: bytes | IO[bytes], cfg: VoicesConfig) -> np.ndarray:
    """The clip (its bytes or a file) as float32 mono 24 kHz, checked; APIError 400 for what
    cannot be a voice."""
    try:
        container = av.open(io.BytesIO(data) if isinstance(data, bytes) else data, mode="r")
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise bad_field(
            "invalid_audio", f"audio: not an audio file FFmpeg can read ({e})", "audio"
        ) from None
    limit = int((cfg.max_seconds + 0.5) * SAMPLE_RATE)
    chunks: list[np.ndarray] = []
    n = 0
    with container:
        if not container.streams.audio:
            raise bad_field("invalid_audio", "audio: the file has no audio stream", "audio")
        stream = container.streams.audio[0]
        ctx = stream.codec_context
        rate = ctx.sample_rate or 0
        channels = ctx.channels or 0
        if rate < MIN_INPUT_RATE:
            raise bad_field(
                "unsupported_sample_format",
                f"audio: sample rate {rate} Hz; at least {MIN_INPUT_RATE} Hz is needed",
                "audio",
            )
        if channels > MAX_CHANNELS:
            raise bad_field(
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
            raise bad_field("invalid_audio", f"audio: undecodable ({e})", "audio") from None
    seconds = n / SAMPLE_RATE
    if n > limit or seconds > cfg.max_seconds:
        raise bad_field(
            "audio_too_long",
            f"audio: longer than {cfg.max_seconds:g} s; send a clip of "
            f"{cfg.min_seconds:g}-{cfg.max_seconds:g} s",
            "audio",
        )
    if seconds < cfg.min_seconds:
        raise bad_field(
            "audio_too_short",
            f"audio: {seconds:.2f} s; send a clip of {cfg.min_seconds:g}-{cfg.max_seconds:g} s",
            "audio",
        )
    pcm = np.concatenate(chunks).astype(np.float32, copy=False)
    if not np.isfinite(pcm).all():
        raise bad_field("invalid_audio", "audio: holds NaN or infinite samples", "audio")
    np.clip(pcm, -1.0, 1.0, out=pcm)
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))
    level = 20 * math.log10(rms) if rms > 0 else -math.inf
    if level < cfg.silence_dbfs:
        raise bad_field(
            "audio_silent",
            f"audio: silent (level {level:.1f} dBFS, below {cfg.silence_dbfs:g})",
            "audio",
        )
    return pcm


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
        self.uploads = Uploads(
            self.cfg.max_concurrent_uploads, config.gateway.retry_after_s, "voice uploads"
        )
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
        req = EncodeRequest(next_request_id() | (os.getpid() << 32), pcm.astype("<f4").tobytes())
        raw = await call_codec(
            self.ctx,
            self.layout.encode,
            req,
            self.cfg.encode_timeout_s,
            doing="encode the clip",
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
        raw = await call_worker(self.ctx, self.layout.engine_admin(engine), msg, ADMIN_TIMEOUT_S)
        if raw is None:
            raise APIError(
                503, "upstream_unavailable", "the llm worker did not answer the admin request"
            )
        return admin_reply_decoder.decode(raw)
