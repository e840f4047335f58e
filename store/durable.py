"""Records in the durable state directory (``voices.state_dir``), which every gateway and the
llm_worker of a node read and several processes (or nodes sharing the volume) change.

A ``RecordDir`` is one directory of records, one file each, ``<id><suffix>``:

- a reader never sees half a file: a record is written to a temporary file in the same
  directory, fsynced, then *linked* to its name (a new record: ``link`` never replaces, so
  two processes creating the same id race safely, one wins and the other gets
  ``FileExistsError``) or *renamed* over it (a new content), and the directory is fsynced;
- a change that checks, then writes (a count limit, a read-modify-write) holds across
  processes inside ``locked()``, an ``flock`` on the directory's ``.lock``;
- only ``<id><suffix>`` with a valid id is a record (not the lock, not a temporary file).

The custom voices (``store.voices.VoiceStore``) and the pronunciation dictionaries
(``gateway.text.store``) are each a ``RecordDir`` with their own encoding and rules; the
LoRA registry writes with ``write_file``, the jobs (``gateway.jobs.store``, files streamed
in) fsync their directories with ``fsync_dir``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

TMP_PREFIX = ".tmp-"


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (a link, a rename, an unlink) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(final: Path, data: bytes, *, replace: bool) -> None:
    """``data`` to ``final`` whole or not at all (a temporary file beside it, fsynced, then
    renamed over ``final`` with ``replace``, else linked: ``FileExistsError`` if ``final``
    exists). The directory must exist; it is fsynced after. No temporary file is left."""
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, final)
        else:
            os.link(tmp, final)  # atomic, and never replaces
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # gone once renamed
    fsync_dir(final.parent)


class RecordDir:
    """One directory of records ``<id><suffix>``, created on the first change."""

    def __init__(self, directory: Path, suffix: str, id_re: re.Pattern[str]) -> None:
        self.directory = directory
        self.suffix = suffix
        self.id_re = id_re

    def path(self, rid: str) -> Path | None:
        """The record's file; None if ``rid`` cannot be an id."""
        if not self.id_re.match(rid):
            return None
        return self.directory / f"{rid}{self.suffix}"

    def _ids(self) -> Iterator[str]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        n_suffix = len(self.suffix)
        for n in names:
            if n.endswith(self.suffix) and self.id_re.match(rid := n[:-n_suffix]):
                yield rid

    def ids(self) -> list[str]:
        return sorted(self._ids())

    def count(self) -> int:
        return sum(1 for _ in self._ids())

    def read(self, rid: str) -> bytes | None:
        """The record's bytes; None if there is none by that id (or it cannot be one)."""
        path = self.path(rid)
        if path is None:
            return None
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def stat_key(self, rid: str) -> tuple[int, int] | None:
        """(inode, mtime ns) of the record's file, None if absent: a cache key that changes
        with every write, and when a record is deleted and made again under the same id."""
        path = self.path(rid)
        if path is None:
            return None
        try:
            st = path.stat()
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_mtime_ns

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's lock (across processes) for a check-then-write."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def write(self, rid: str, data: bytes, *, replace: bool) -> None:
        """Store a record (``write_file``): ``FileExistsError`` when ``replace`` is False and
        the id is taken; ``ValueError`` if ``rid`` cannot be an id."""
        path = self.path(rid)
        if path is None:
            raise ValueError(f"not a record id: {rid!r}")
        self.directory.mkdir(parents=True, exist_ok=True)
        write_file(path, data, replace=replace)

    def remove(self, rid: str) -> bool:
        """Delete a record; False if there was none (or ``rid`` cannot be an id)."""
        path = self.path(rid)
        if path is None:
            return False
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        fsync_dir(self.directory)
        return True
