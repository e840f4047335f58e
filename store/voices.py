"""Custom voices (the ``[voices]`` table): zero-shot voices made from reference audio, kept in
a state directory that every gateway and the llm_worker read.

One file per voice, ``<state_dir>/voices/<id>.voice`` (a msgpack :class:`VoiceRecord`: the
transcript and the reference audio's SNAC code frames), a ``store.durable.RecordDir``: written
atomically and *linked* to its final name (two gateways creating the same name race safely:
one wins, the other answers 409); creation holds the directory's lock so that the voice
limit holds across processes. Deleting unlinks the file: a stream that already started
keeps the prompt it was given.

Import-light (msgspec, numpy, the standard library): the gateway (which never touches torch)
and the llm_worker both use it.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
import numpy as np

from shm.messages import UNDECODABLE
from shm.records import CODE_DTYPE, FRAME_BYTES, FRAME_CODES
from store.durable import RecordDir, write_file

VOICE_SUFFIX = ".voice"
ID_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,63}$")
"""A custom voice id: what a request names as ``voice`` (lower case, as voices are matched)."""


class VoicesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    state_dir: str = "~/.local/state/orpheus-serve"
    """Directory of the server's durable state; custom voices live in its ``voices/``. Every
    gateway and the llm_worker of a node (and nodes sharing a volume) must see the same one."""
    max_voices: int = 100
    """Most custom (zero-shot) voices the state directory may hold."""
    min_seconds: float = 3.0
    """Shortest reference clip accepted (after resampling to 24 kHz mono)."""
    max_seconds: float = 30.0
    """Longest reference clip accepted. Its codes are a prompt prefix: 30 s is about 2,460
    tokens, which must fit in ``llm.max_model_len`` with room for speech."""
    max_upload_bytes: int = 16 << 20
    """Largest ``POST /v1/audio/voices`` body (the audio file and the form fields)."""
    max_concurrent_uploads: int = 2
    """``POST /v1/audio/voices`` calls one gateway process serves at once; one more is
    answered 429 ``too_many_uploads`` at once, before its body is read. The audio is spooled
    (to a temporary file past 1 MiB), never held whole in memory twice."""
    silence_dbfs: float = -50.0
    """A clip whose RMS level is below this (dB full scale) is refused as silent."""
    max_transcript_chars: int = 1000
    """Longest reference transcript accepted (it is tokenized into every request's prompt)."""
    encode_timeout_s: float = 60.0
    """How long the gateway waits for the codec worker to encode a reference clip."""


class VoiceRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One custom voice as stored (and as the llm_worker reads it)."""

    id: str
    name: str
    transcript: str
    description: str = ""
    created_at: int
    """Unix seconds."""
    duration_s: float
    """Length of the reference clip at 24 kHz."""
    codes: bytes
    """The reference audio's SNAC code frames: int16 little-endian, ``(frames, 7)`` in
    Orpheus slot order (what the model emits)."""
    language: str | None = None
    """The language (ISO 639-1) of a request for this voice that names none; None: the
    checkpoint's."""

    @property
    def frames(self) -> int:
        return len(self.codes) // FRAME_BYTES

    def code_frames(self) -> np.ndarray:
        return np.frombuffer(self.codes, dtype=CODE_DTYPE).reshape(-1, FRAME_CODES)


class VoiceSummary(msgspec.Struct, frozen=True, kw_only=True):
    """A custom voice as listed (no codes)."""

    id: str
    name: str
    description: str
    created_at: int
    duration_s: float
    frames: int
    type: str = "zero_shot"
    language: str | None = None


class VoiceExists(Exception):
    pass


class TooManyVoices(Exception):
    pass


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(VoiceRecord)


def voice_id(name: str) -> str:
    """The id of a voice called ``name``; ValueError if the name cannot be one."""
    vid = name.strip().lower()
    if not ID_RE.match(vid):
        raise ValueError(
            "name must be 1-64 characters of letters, digits, '_', '-' or '.', "
            "starting with a letter or digit"
        )
    return vid


def resolve_state_dir(path: str) -> Path:
    return Path(os.path.expanduser(os.path.expandvars(path)))


class VoiceStore:
    """The ``voices/`` directory of a state directory (created on first use)."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.records = RecordDir(resolve_state_dir(str(state_dir)) / "voices", VOICE_SUFFIX, ID_RE)
        self.directory = self.records.directory

    def path(self, vid: str) -> Path:
        path = self.records.path(vid)
        if path is None:
            raise ValueError(f"not a voice id: {vid!r}")
        return path

    def ids(self) -> list[str]:
        return self.records.ids()

    def get(self, vid: str) -> VoiceRecord | None:
        """The voice, or None if there is none by that id (or the id is malformed)."""
        data = self.records.read(vid)
        return None if data is None else _decoder.decode(data)

    def stat_key(self, vid: str) -> tuple[int, int] | None:
        """(inode, mtime ns) of the voice's file, None if absent: a cache key that changes
        when a voice is deleted and made again under the same id."""
        return self.records.stat_key(vid)

    def list(self) -> list[VoiceSummary]:
        out = []
        for vid in self.ids():
            try:
                r = self.get(vid)
            except (msgspec.DecodeError, OSError):
                continue  # a damaged file is skipped here; the llm_worker answers it 400
            if r is not None:
                out.append(
                    VoiceSummary(
                        id=r.id,
                        name=r.name,
                        description=r.description,
                        created_at=r.created_at,
                        duration_s=r.duration_s,
                        frames=r.frames,
                        language=r.language,
                    )
                )
        return out

    def create(self, record: VoiceRecord, max_voices: int) -> None:
        """Store ``record`` atomically. VoiceExists if the id is taken, TooManyVoices at the
        limit (both checked under the store's lock, so they hold across processes)."""
        final = self.path(record.id)
        with self.records.locked():
            if final.exists():
                raise VoiceExists(record.id)
            if self.records.count() >= max_voices:
                raise TooManyVoices(max_voices)
            try:
                self.records.write(record.id, _encoder.encode(record), replace=False)
            except FileExistsError:
                raise VoiceExists(record.id) from None

    def delete(self, vid: str) -> bool:
        """Remove a voice; False if there was none."""
        return self.records.remove(vid)


def new_record(
    vid: str,
    name: str,
    transcript: str,
    description: str,
    frames: np.ndarray,
    seconds: float,
    language: str | None = None,
) -> VoiceRecord:
    codes = np.ascontiguousarray(frames, dtype=CODE_DTYPE).reshape(-1, FRAME_CODES)
    return VoiceRecord(
        id=vid,
        name=name,
        transcript=transcript,
        description=description,
        created_at=int(time.time()),
        duration_s=round(seconds, 3),
        codes=codes.tobytes(),
        language=language,
    )


# -- LoRA voices loaded at run time ------------------------------------------------------------


class LoraEntry(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA voice loaded through the admin API (``<state_dir>/lora/<name>.json``), so that
    a restarted llm_worker loads it again and every gateway lists it."""

    name: str
    path: str
    speaker: str | None = None
    language: str | None = None
    """The voice's language (ISO 639-1); None: the checkpoint's."""


_lora_encoder = msgspec.json.Encoder()
_lora_decoder = msgspec.json.Decoder(LoraEntry)

LoraSignature = tuple[int, int, int]
"""(inode, mtime ns, size) of an entry's file: ``save`` replaces the file, so it changes
whenever an entry is written again, even with the same content."""


class LoraScan(NamedTuple):
    """One entry as ``LoraRegistry.scan`` found it."""

    entry: LoraEntry | None
    """None: the file exists but could not be read or decoded."""
    signature: LoraSignature | None
    """None: the file could not be stat'ed."""


def _signature(st: os.stat_result) -> LoraSignature:
    return (st.st_ino, st.st_mtime_ns, st.st_size)


LORA_SUFFIX = ".json"
FAILED_SUFFIX = ".failed"
MAX_REASON_CHARS = 500


class LoraRegistry:
    """The ``lora/`` directory of a state directory: one ``<id>.json`` entry per LoRA voice
    loaded at run time, and beside it ``<id>.failed`` (one line: why) while an llm_worker
    could not load that entry (again at start, or when it synced an entry another worker
    sharing the directory wrote).

    The llm_workers are the authority: one writes the entry once an adapter is loaded (which
    clears a marker), the marker when loading an entry it did not write fails, and removes
    both on unload; every worker sharing the directory follows it (``LoraVoices.sync``).
    Gateways only read: a stat of the entry (``has``) and, for a LoRA voice, of the marker
    (``failure``), per request."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.directory = resolve_state_dir(str(state_dir)) / "lora"

    def _path(self, name: str, suffix: str) -> Path:
        """ValueError if ``name`` cannot be a voice id."""
        return self.directory / f"{voice_id(name)}{suffix}"

    def entries(self) -> list[LoraEntry]:
        """The entries that can be read, by voice id (``scan`` without the signatures)."""
        found = self.scan()
        return [e for _, (e, _sig) in sorted(found.items()) if e is not None]

    def scan(self, previous: Mapping[str, LoraScan] | None = None) -> dict[str, LoraScan]:
        """Every entry by voice id (the file's name), each with its file's signature, in one
        pass over the directory: one ``stat`` per entry, and a read only of an entry whose
        signature is not the one in ``previous`` (an earlier scan). An entry that cannot be
        read or decoded is listed with ``entry`` None: it exists, what it holds is unknown.
        Empty if the directory does not exist; other OSErrors (listing it) are raised."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return {}
        previous = previous or {}
        out: dict[str, LoraScan] = {}
        for n in names:
            if not n.endswith(LORA_SUFFIX) or n.startswith("."):
                continue  # markers (.failed) and temporary files
            vid = n[: -len(LORA_SUFFIX)]
            if not ID_RE.match(vid):
                continue
            path = self.directory / n
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # deleted since the listing
            except OSError:
                out[vid] = LoraScan(None, None)
                continue
            sig = _signature(st)
            if (known := previous.get(vid)) is not None and known.signature == sig:
                out[vid] = known
                continue
            try:
                with open(path, "rb") as f:
                    st = os.fstat(f.fileno())  # the signature of what is read
                    data = f.read()
            except FileNotFoundError:
                continue
            except OSError:
                out[vid] = LoraScan(None, None)
                continue
            sig = _signature(st)
            try:
                out[vid] = LoraScan(_lora_decoder.decode(data), sig)
            except UNDECODABLE:
                out[vid] = LoraScan(None, sig)
        return out

    def _write(self, final: Path, data: bytes) -> None:
        """``data`` to ``final`` atomically (a temporary file, fsynced, renamed over it)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        write_file(final, data, replace=True)

    def save(self, entry: LoraEntry) -> None:
        """Store ``entry`` (its adapter was loaded): written atomically, and a failure marker
        left by an earlier start is cleared."""
        self._write(self._path(entry.name, LORA_SUFFIX), _lora_encoder.encode(entry))
        self.clear_failure(entry.name)

    def language(self, name: str, cache: dict[str, tuple[LoraSignature, str | None]]) -> str | None:
        """The language of the LoRA voice ``name`` loaded at run time (None: it has none, or
        there is no such entry). A stat per call; the entry is read again only when its
        signature is not the one in ``cache`` (the caller's, updated here)."""
        try:
            path = self._path(name, LORA_SUFFIX)
            sig = _signature(path.stat())
        except (ValueError, OSError):
            cache.pop(name, None)
            return None
        known = cache.get(name)
        if known is not None and known[0] == sig:
            return known[1]
        try:
            language = _lora_decoder.decode(path.read_bytes()).language
        except (OSError, *UNDECODABLE):
            return None
        cache[name] = (sig, language)
        return language

    def has(self, name: str) -> bool:
        """Whether a LoRA voice ``name`` was loaded at run time (its entry exists; a stat,
        no file is read). True also while its failure marker is set: see ``failure``."""
        try:
            return self._path(name, LORA_SUFFIX).is_file()
        except ValueError:
            return False

    def mark_failed(self, name: str, reason: str) -> None:
        """Record that the entry ``name`` could not be loaded (atomically, like ``save``):
        ``reason`` is stored as one line of at most ``MAX_REASON_CHARS`` characters."""
        line = " ".join(reason.split())[:MAX_REASON_CHARS] or "unknown error"
        self._write(self._path(name, FAILED_SUFFIX), line.encode() + b"\n")

    def failure(self, name: str) -> str | None:
        """Why the entry ``name`` failed to load, or None: it did not (no marker; one open
        that fails, no file is read), or the name cannot be an id."""
        try:
            reason = self._path(name, FAILED_SUFFIX).read_text(errors="replace").strip()
        except (FileNotFoundError, ValueError):
            return None
        return reason or "unknown error"

    def clear_failure(self, name: str) -> None:
        """Remove the failure marker of ``name``, if any."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            self._path(name, FAILED_SUFFIX).unlink()

    def delete(self, name: str) -> bool:
        """Remove the entry ``name`` and its failure marker; False if there was no entry."""
        self.clear_failure(name)
        try:
            self._path(name, LORA_SUFFIX).unlink()
        except (FileNotFoundError, ValueError):
            return False
        return True


# -- which voice a name is: one order, one message, for the gateway and the llm_worker ----------

VoiceKind = Literal["model", "lora", "custom"]


def unknown_voice(voice: str, model_voices: Iterable[str]) -> str:
    """The message of a voice this server does not have (a 400, ``bad_request``)."""
    return (
        f"unknown voice {voice!r}; voices: {', '.join(model_voices)} "
        "(and the custom voices listed by GET /v1/audio/voices)"
    )


def lora_unavailable(vid: str, reason: str) -> str:
    """The message of a LoRA voice whose entry the llm_worker could not load (at start or
    when it synced the registry; a 503, ``voice_unavailable``; ``LoraRegistry.failure`` is ``reason``)."""
    return (
        f"LoRA voice {vid!r} failed to load in the llm worker: {reason}; "
        "load it again with POST /v1/admin/lora (or remove it with DELETE /v1/admin/lora/"
        f"{vid})"
    )


def zero_shot_unsupported(vid: str) -> str:
    """The message of a custom voice named while the model takes none (a 400)."""
    return (
        f"voice {vid!r} is a custom (zero-shot) voice, and this model does not declare "
        "zero-shot support (config.json 'orpheus.zero_shot'; [llm] zero_shot)"
    )


class VoiceLookup:
    """Which kind of voice a name is, in the one order both the gateway (before admission)
    and the llm_worker (when the stream starts) look it up:

    1. a voice of the model (``llm.voices`` / the checkpoint's, stripped, lower case): no
       file is touched, so the common request costs nothing here;
    2. a LoRA voice (``[llm] lora_voices``, or loaded at run time: ``LoraRegistry``);
    3. a custom (zero-shot) voice (``VoiceStore``).

    Names are looked up as voices are matched: stripped, lower case (aliases are the
    gateway's and are resolved before). A LoRA voice and a custom voice never share a name
    with a model voice (the configuration's check, and the create/load handlers refuse
    taken names); where a custom voice and a LoRA voice do share one (a LoRA configured
    after the voice was made), the LoRA voice wins.

    ``is_lora`` and ``is_custom`` are each process's own view (the gateway's: files in the
    state directory; the worker's: the adapters it loaded and the store)."""

    def __init__(
        self,
        model_voices: Iterable[str],
        is_lora: Callable[[str], bool] | None = None,
        is_custom: Callable[[str], bool] | None = None,
    ) -> None:
        self.model_voices = tuple(dict.fromkeys(v.strip().lower() for v in model_voices))
        self._model = frozenset(self.model_voices)
        self._is_lora = is_lora
        self._is_custom = is_custom

    def kind(self, voice: str) -> VoiceKind | None:
        """The kind of voice ``voice`` is; None: this server has no such voice."""
        key = voice.strip().lower()
        if key in self._model:
            return "model"
        if not ID_RE.match(key):
            return None
        if self._is_lora is not None and self._is_lora(key):
            return "lora"
        if self._is_custom is not None and self._is_custom(key):
            return "custom"
        return None

    def unknown(self, voice: str) -> str:
        """The message for ``voice`` when ``kind`` found nothing."""
        return unknown_voice(voice, self.model_voices)
