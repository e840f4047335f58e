"""Pronunciation dictionaries on disk, beside the custom voices (``voices.state_dir``).

One file per dictionary, ``<state_dir>/pronunciation/<id>.json``: its name, owner and every
version kept (each change makes a new version with a new id; the oldest are dropped past
``text.max_dictionary_versions``). The store follows ``shm.voices.VoiceStore``'s rules:
records are written to a temporary file in the same directory, fsynced, then linked
(creation: never replaces) or renamed (a new version) into place, and the directory fsynced;
every change holds an ``flock`` on ``.lock`` so that the count limit and read-modify-write
updates hold across gateway processes (and nodes sharing the volume). A reader never sees
half a file.

Ownership: a dictionary belongs to the API key that made it (a SHA-256 prefix of it is
stored, never the key); other keys neither see nor use it (404), admin keys see all. With no
API keys configured everything is everyone's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from gateway.text.lexicon import AliasRule

ID_RE = re.compile(r"^[A-Za-z0-9]{8,40}$")
SUFFIX = ".json"


class DictionaryVersion(msgspec.Struct, frozen=True, kw_only=True):
    version_id: str
    created_at: int
    rules: list[AliasRule]


class DictionaryRecord(msgspec.Struct, frozen=True, kw_only=True):
    id: str
    name: str
    description: str | None = None
    owner: str | None = None
    """SHA-256 prefix of the creating API key; None: made with no key."""
    created_at: int
    versions: list[DictionaryVersion]
    """Oldest first; the last is the latest."""

    @property
    def latest(self) -> DictionaryVersion:
        return self.versions[-1]

    def version(self, version_id: str | None) -> DictionaryVersion | None:
        if version_id is None:
            return self.latest
        for v in self.versions:
            if v.version_id == version_id:
                return v
        return None


class TooManyDictionaries(Exception):
    pass


class NoSuchDictionary(Exception):
    pass


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(DictionaryRecord)


def new_id() -> str:
    """20 characters of letters and digits, as ElevenLabs' ids."""
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    return "".join(secrets.choice(alphabet) for _ in range(20))


class DictionaryStore:
    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        base = Path(os.path.expanduser(os.path.expandvars(str(state_dir))))
        self.directory = base / "pronunciation"

    def path(self, did: str) -> Path:
        if not ID_RE.match(did):
            raise NoSuchDictionary(did)
        return self.directory / f"{did}{SUFFIX}"

    def ids(self) -> list[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(
            n[: -len(SUFFIX)]
            for n in names
            if n.endswith(SUFFIX) and ID_RE.match(n[: -len(SUFFIX)])
        )

    def stat_key(self, did: str) -> tuple[int, int] | None:
        try:
            st = self.path(did).stat()
        except (FileNotFoundError, NoSuchDictionary):
            return None
        return st.st_ino, st.st_mtime_ns

    def get(self, did: str) -> DictionaryRecord | None:
        try:
            data = self.path(did).read_bytes()
        except (FileNotFoundError, NoSuchDictionary):
            return None
        return _decoder.decode(data)

    def list(self) -> list[DictionaryRecord]:
        out = []
        for did in self.ids():
            try:
                r = self.get(did)
            except (msgspec.DecodeError, OSError):
                continue  # a damaged file is skipped
            if r is not None:
                out.append(r)
        return out

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, record: DictionaryRecord, *, replace: bool) -> None:
        final = self.path(record.id)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_encoder.encode(record))
                f.flush()
                os.fsync(f.fileno())
            if replace:
                os.replace(tmp, final)
            else:
                os.link(tmp, final)  # never replaces: an id collision fails
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        dfd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def create(
        self,
        *,
        name: str,
        description: str | None,
        owner: str | None,
        rules: list[AliasRule],
        max_dictionaries: int,
    ) -> DictionaryRecord:
        now = int(time.time())
        record = DictionaryRecord(
            id=new_id(),
            name=name,
            description=description,
            owner=owner,
            created_at=now,
            versions=[DictionaryVersion(version_id=new_id(), created_at=now, rules=rules)],
        )
        with self._locked():
            if len(self.ids()) >= max_dictionaries:
                raise TooManyDictionaries(max_dictionaries)
            self._write(record, replace=False)
        return record

    def new_version(self, did: str, change: object, max_versions: int) -> DictionaryRecord:
        """Apply ``change`` (rules of the latest version -> new rules; it may raise) under
        the lock and store the result as a new latest version."""
        assert callable(change)
        with self._locked():
            record = self.get(did)
            if record is None:
                raise NoSuchDictionary(did)
            rules = change(list(record.latest.rules))
            version = DictionaryVersion(
                version_id=new_id(), created_at=int(time.time()), rules=rules
            )
            versions = [*record.versions, version][-max_versions:]
            record = msgspec.structs.replace(record, versions=versions)
            self._write(record, replace=True)
        return record

    def rename(self, did: str, name: str) -> DictionaryRecord:
        """A new name (no new version: the rules are unchanged)."""
        with self._locked():
            record = self.get(did)
            if record is None:
                raise NoSuchDictionary(did)
            record = msgspec.structs.replace(record, name=name)
            self._write(record, replace=True)
        return record

    def delete(self, did: str) -> bool:
        with self._locked():
            try:
                self.path(did).unlink()
            except (FileNotFoundError, NoSuchDictionary):
                return False
        return True
