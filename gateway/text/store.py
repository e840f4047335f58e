"""Pronunciation dictionaries on disk, beside the custom voices (``voices.state_dir``).

One file per dictionary, ``<state_dir>/pronunciation/<id>.json``: its name, owner and every
version kept (each change makes a new version with a new id; the oldest are dropped past
``text.max_dictionary_versions``). The directory is a ``store.durable.RecordDir``, as the
custom voices' is: records are linked (creation: never replaces) or renamed (a new version)
into place whole, and every change holds the directory's lock so that the count limit and
read-modify-write updates hold across gateway processes (and nodes sharing the volume). A
reader never sees half a file.

Ownership: a dictionary belongs to the API key that made it (a SHA-256 prefix of it is
stored, never the key); other keys neither see nor use it (404), admin keys see all. With no
API keys configured everything is everyone's.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from pathlib import Path

import msgspec

from gateway.text.lexicon import AliasRule
from store.durable import RecordDir

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
    language: str | None = None
    """The language (ISO 639-1) of its PLS file's ``xml:lang``: it applies only to requests
    in that language. None (made from rules, or a PLS file without one): to every request."""

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
        self.records = RecordDir(base / "pronunciation", SUFFIX, ID_RE)
        self.directory = self.records.directory

    def path(self, did: str) -> Path:
        path = self.records.path(did)
        if path is None:
            raise NoSuchDictionary(did)
        return path

    def ids(self) -> list[str]:
        return self.records.ids()

    def stat_key(self, did: str) -> tuple[int, int] | None:
        return self.records.stat_key(did)

    def get(self, did: str) -> DictionaryRecord | None:
        data = self.records.read(did)
        return None if data is None else _decoder.decode(data)

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

    def _write(self, record: DictionaryRecord, *, replace: bool) -> None:
        self.records.write(record.id, _encoder.encode(record), replace=replace)

    def create(
        self,
        *,
        name: str,
        description: str | None,
        owner: str | None,
        rules: list[AliasRule],
        max_dictionaries: int,
        language: str | None = None,
    ) -> DictionaryRecord:
        now = int(time.time())
        record = DictionaryRecord(
            id=new_id(),
            name=name,
            description=description,
            owner=owner,
            created_at=now,
            versions=[DictionaryVersion(version_id=new_id(), created_at=now, rules=rules)],
            language=language,
        )
        with self.records.locked():
            if len(self.ids()) >= max_dictionaries:
                raise TooManyDictionaries(max_dictionaries)
            self._write(record, replace=False)
        return record

    def new_version(self, did: str, change: object, max_versions: int) -> DictionaryRecord:
        """Apply ``change`` (rules of the latest version -> new rules; it may raise) under
        the lock and store the result as a new latest version."""
        assert callable(change)
        with self.records.locked():
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
        with self.records.locked():
            record = self.get(did)
            if record is None:
                raise NoSuchDictionary(did)
            record = msgspec.structs.replace(record, name=name)
            self._write(record, replace=True)
        return record

    def delete(self, did: str) -> bool:
        with self.records.locked():
            return self.records.remove(did)
