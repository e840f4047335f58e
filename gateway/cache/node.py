"""The node's cache entries: files in one directory, shared by every gateway process of the
node.

Files rather than shared memory: every gateway process (and a restarted one) sees the same
entries with no segment to size up front, the page cache keeps the hot ones in memory, a
crash cannot leave a lock held, and entries outlive a restart. Layout::

    <dir>/<tenant id>/<key digest>.pcm    an entry (``gateway.cache.entry``: header + PCM)
    <dir>/<tenant id>/<key digest>.seen   its sightings: one byte appended per synthesis
    <dir>/<tenant id>/.tmp-*              an entry (or a flight's log) being written
    <dir>/<tenant id>/<key digest>.flight a unit being synthesised, as the node's gateway
    <dir>/<tenant id>/<key digest>.join   processes share it (``gateway.cache.flight``)

The tenant id is a digest of the tenant (no key is written in clear), so a key's purge is
one directory. An entry is written to a temporary file in its directory, fsynced, then
renamed to its name: a reader sees a whole entry or none, and a writer killed mid-write
leaves only a temporary file, which no lookup reads and the next sweep removes; an entry
whose checksum fails anyway (a damaged disk) is a miss and is removed.

Admission and eviction (bench/cache/policy.py measured them on a voice-agent trace): a unit
is stored once it has been synthesised ``admit_after`` times (its ``.seen`` file's length:
appends from several processes add up), so one-off sentences never push out the phrases
that repeat; entries leave least recently used first (a hit touches the file's time), and
after ``ttl_s`` (the time in the header). The byte bound holds over the node: a process
sweeps the directory (every process's entries) once its own writes since its last sweep
pass a sixteenth of the bound, or its estimate passes the bound, and then evicts down to
90 %; between sweeps each process may add at most that sixteenth.

Every method here does disk I/O and may block: ``gateway.cache.service`` runs them in a
thread. None raises for a missing or damaged file; OSError of the disk itself (full, gone)
is the caller's to count and swallow.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

from gateway.cache import entry, flight

ENTRY = ".pcm"
SEEN = ".seen"
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 60.0
"""A temporary file this old was left by a writer that died: the sweep removes it."""
MAX_SIGHTINGS = 65_536
"""Sighting files the node keeps at most (the oldest go first): a flood of one-off
sentences costs a bounded number of inodes."""
SIGHTING_TTL_S = 86_400.0
"""A sighting older than this is forgotten (PolyAI's rule: twice in 24 hours)."""
LOW_WATER = 0.9


class SweepResult(NamedTuple):
    entries: int
    bytes: int
    evicted: int
    expired: int


def tenant_id(tenant: str) -> str:
    return hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()


class NodeCache:
    """The node's entries in ``directory`` (created on first use); see the module docstring."""

    def __init__(
        self, directory: Path, *, max_bytes: int, ttl_s: float, admit_after: int = 2
    ) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.admit_after = max(1, admit_after)
        self.bytes_estimate = 0
        """The node's entry bytes as of this process's last sweep, plus its writes since."""
        self._written_since_sweep = 0
        self.entries = 0
        self.swept_at = 0.0
        self.last_sweep: SweepResult | None = None

    def tenant_dir(self, tenant: str) -> Path:
        """The directory of ``tenant``'s entries (and flights: ``gateway.cache.flight``)."""
        return self.directory / tenant_id(tenant)

    def path(self, tenant: str, digest: str) -> Path:
        return self.tenant_dir(tenant) / (digest + ENTRY)

    # -- lookups ---------------------------------------------------------------------------
    def get(self, tenant: str, digest: str, now: float | None = None) -> bytes | None:
        """The entry's PCM, or None (absent, expired, torn or damaged: then removed)."""
        now = time.time() if now is None else now
        path = self.path(tenant, digest)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None
        pcm = entry.decode(digest, data, not_before=now - self.ttl_s)
        if pcm is None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # recency, for the eviction order
        return pcm

    def sighted(self, tenant: str, digest: str) -> int:
        """Count one synthesis of the unit; its sightings so far (this one included)."""
        if self.admit_after <= 1:
            return 1
        d = self.tenant_dir(tenant)
        d.mkdir(parents=True, exist_ok=True)
        fd = os.open(d / (digest + SEEN), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, b".")
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    # -- writes ----------------------------------------------------------------------------
    def put(
        self,
        tenant: str,
        digest: str,
        pcm: bytes,
        now: float | None = None,
        *,
        force: bool = False,
    ) -> bool:
        """Store the unit's PCM if its sightings admit it (``sighted`` counted this
        synthesis) or ``force`` (a request that asked for new audio: ``no-cache``). True if
        written. Sweeps when this process wrote enough since its last."""
        d = self.tenant_dir(tenant)
        if self.admit_after > 1 and not force:
            try:
                seen = (d / (digest + SEEN)).stat().st_size
            except FileNotFoundError:
                seen = 0
            if seen < self.admit_after:
                return False
        if entry.HEADER_BYTES + len(pcm) > self.max_bytes // 4:
            return False  # one entry may not take a quarter of the cache
        d.mkdir(parents=True, exist_ok=True)
        data = entry.encode(digest, pcm, time.time() if now is None else now)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=d)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, d / (digest + ENTRY))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        with contextlib.suppress(FileNotFoundError):
            (d / (digest + SEEN)).unlink()  # stored: its sightings are done
        self.bytes_estimate += len(data)
        self._written_since_sweep += len(data)
        if self._written_since_sweep > self.max_bytes // 16 or self.bytes_estimate > self.max_bytes:
            self.sweep()
        return True

    def purge(self, tenant: str) -> int:
        """Remove every entry and sighting of ``tenant``; the number of entries removed."""
        d = self.tenant_dir(tenant)
        try:
            n = sum(1 for f in os.scandir(d) if f.name.endswith(ENTRY))
        except FileNotFoundError:
            return 0
        shutil.rmtree(d, ignore_errors=True)
        return n

    def purge_all(self) -> int:
        """Remove every entry and sighting of the node; the number of entries removed."""
        try:
            tenants = [t.path for t in os.scandir(self.directory) if t.is_dir()]
        except FileNotFoundError:
            return 0
        n = 0
        for t in tenants:
            with contextlib.suppress(FileNotFoundError):
                n += sum(1 for f in os.scandir(t) if f.name.endswith(ENTRY))
            shutil.rmtree(t, ignore_errors=True)
        self.bytes_estimate = 0
        return n

    # -- the bound -------------------------------------------------------------------------
    def sweep(self, now: float | None = None) -> SweepResult:
        """Scan every tenant's entries: remove the expired ones, stale temporary files, old
        sightings and the files of flights nobody leads or follows any more, then the least
        recently used entries until the node's bytes are under 90 % of the bound (if they
        passed it)."""
        now = time.time() if now is None else now
        entries: list[tuple[float, int, str]] = []
        sightings: list[tuple[float, str]] = []
        expired = 0
        total = 0
        try:
            tenants = list(os.scandir(self.directory))
        except FileNotFoundError:
            tenants = []
        for t in tenants:
            if not t.is_dir(follow_symlinks=False):
                continue
            try:
                files = list(os.scandir(t.path))
            except FileNotFoundError:
                continue
            joins: list[str] = []
            for f in files:
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if f.name.endswith(ENTRY):
                    # mtime: the last hit or the write, never before the header's made-at
                    # time; an entry hit lately but made too long ago is refused by ``get``.
                    if now - st.st_mtime > self.ttl_s:
                        _unlink(f.path)
                        expired += 1
                        continue
                    entries.append((st.st_mtime, st.st_size, f.path))
                    total += st.st_size
                elif f.name.endswith(SEEN):
                    if now - st.st_mtime > min(self.ttl_s, SIGHTING_TTL_S):
                        _unlink(f.path)
                    else:
                        sightings.append((st.st_mtime, f.path))
                elif f.name.startswith(TMP_PREFIX) and now - st.st_mtime > STALE_TMP_S:
                    _unlink(f.path)
                elif f.name.endswith(flight.FLIGHT) and now - st.st_mtime > STALE_TMP_S:
                    flight.remove_if_stale(f.path)  # its leader gone
                elif f.name.endswith(flight.JOIN) and now - st.st_mtime > STALE_TMP_S:
                    joins.append(f.path)  # once the logs are swept
            for path in joins:
                flight.remove_if_stale(path)  # its log gone, and its followers
        evicted = 0
        if total > self.max_bytes:
            entries.sort()
            target = int(self.max_bytes * LOW_WATER)
            i = 0
            while total > target and i < len(entries):
                _, size, path = entries[i]
                _unlink(path)
                total -= size
                evicted += 1
                i += 1
        if len(sightings) > MAX_SIGHTINGS:
            sightings.sort()
            for _, path in sightings[: len(sightings) - MAX_SIGHTINGS]:
                _unlink(path)
        for t in tenants:  # a purged or emptied tenant's directory goes
            with contextlib.suppress(OSError):
                os.rmdir(t.path)
        self.bytes_estimate = total
        self._written_since_sweep = 0
        self.entries = len(entries) - evicted
        self.swept_at = now
        self.last_sweep = SweepResult(self.entries, total, evicted, expired)
        return self.last_sweep


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
