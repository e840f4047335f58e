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

import os
import re
import time
from pathlib import Path

import msgspec
import numpy as np

from shm.records import CODE_DTYPE, FRAME_BYTES, FRAME_CODES
from store.durable import RecordDir

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
