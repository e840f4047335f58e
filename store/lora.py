"""The LoRA voices loaded at run time (through the admin API), kept in the state directory's
``lora/`` so that a restarted llm_worker loads them again, every worker sharing the directory
follows them and every gateway lists them: one JSON entry per voice, written whole
(``store.durable.write_file``), and a failure marker beside an entry a worker could not load.

Import-light (msgspec and the standard library): the gateway reads the registry (a stat per
request), the llm_worker writes it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import msgspec

from shm.messages import UNDECODABLE
from store.durable import write_file
from store.voices import ID_RE, resolve_state_dir, voice_id


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
