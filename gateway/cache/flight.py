"""A unit's synthesis as the node's gateway processes share it (single flight): the leader's
audio, written as it is made to a file that the other processes read as it grows.

Twins of one unit that reach one gateway process follow its leader in memory
(``gateway.requests``). Twins in the node's other processes follow it through two files
beside the entries, in the tenant's directory (``gateway.cache.node``; another tenant never
follows)::

    <dir>/<tenant id>/<key digest>.flight  the leader's log: its PCM as it is made, then its end
    <dir>/<tenant id>/<key digest>.join    its listeners in other processes: one shared lock each

The log: ``MAGIC`` (its format's version), then frames of ``<kind u8><length u32><payload>``:
PCM frames, then one terminal frame, the leader's ``StreamEnd`` (``END``) or ``StreamError``
(``FAILED``), msgpack. A reader delivers complete frames only (a frame half written is read
again once whole).

- The leader (``FlightLog.claim``) writes its log's first bytes to a temporary file on
  which it holds ``flock(LOCK_EX)``, then links it to its name, which fails if the name is
  taken (another process leads: this one synthesises without a log of its own). A log is
  thus never seen without its lock, which is the leader's liveness: the kernel drops it
  with the process. At its end the leader writes the terminal frame, unlinks both files
  (if they are still its own) and only then closes them (lets go of the lock).
- The leader's own client is told its stream's end once the log is ended
  (``PcmStream.finish``): a request that comes after that never follows the flight, as in
  one process; a log found with its terminal is not joined.
- A follower (``FlightReader.open``; one per process and unit, whose twins follow it there)
  opens the log and tries ``flock(LOCK_SH | LOCK_NB)``: refused, the leader lives. Granted,
  the leader is gone: a log still under its name was left by a leader that died (removed
  here, if it is still the one opened: the caller leads anew). A follower of a live leader
  holds ``LOCK_SH`` on the join file while it follows, and reads the log once it has it.
- A leader whose own client left, with no follower in its process, asks for ``LOCK_EX |
  LOCK_NB`` on the join file (``FlightLog.nobody_listens``): refused, someone listens and
  it goes on to its end; granted, nobody does, and it keeps the lock until its terminal
  frame (cancelled) is written. A follower refused ``LOCK_SH`` synthesises itself, and so
  does one granted it after the leader let go (it finds the terminal): nobody follows a
  flight being cancelled.
- A follower that finds no new bytes checks the leader's lock again: gone without a
  terminal frame, the leader died and the followers fail at once (``LEADER_DIED``).
- The sweep (``gateway.cache.node``) removes a log nobody locks and a join file whose log
  is gone and nobody locks (``remove_if_stale``); a tenant's purge unlinks both while the
  leader and its followers hold them open, and they go on.

Every function here does disk I/O and may block (a flight's thread, or a read of a file
just written, which the page cache holds; ``gateway.cache.relay``). OSError of the disk is
the caller's.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import tempfile
from pathlib import Path
from typing import NamedTuple

import msgspec

from shm.records import StreamEnd, StreamError, end_decoder, error_decoder, record_encoder

FLIGHT = ".flight"
JOIN = ".join"
TMP_PREFIX = ".tmp-flight-"
"""A log before it is linked to its name (``gateway.cache.node``'s sweep removes those a
leader left behind, as for entries)."""
MAGIC = b"OFLIGHT\x01"
"""A log's first bytes: its format, version 1."""
PCM, END, FAILED = 0, 1, 2
_FRAME = struct.Struct("<BI")
MAX_FRAME = 64 << 20
"""A frame that says it is longer is damage."""

Terminal = StreamEnd | StreamError
"""A log's last frame: how the leader's stream ended."""

LEADER_DIED = StreamError(
    "flight_leader_died",
    "the gateway process that was synthesising this sentence for it died; ask again",
    503,
)


class FlightDamaged(ValueError):
    """A log whose bytes are no frames (not this version's, or damaged)."""


def pcm_frame(pcm: bytes) -> bytes:
    return _FRAME.pack(PCM, len(pcm)) + pcm


def terminal_frame(terminal: Terminal) -> bytes:
    payload = record_encoder.encode(terminal)
    return _FRAME.pack(END if isinstance(terminal, StreamEnd) else FAILED, len(payload)) + payload


def parse(data: bytes | memoryview) -> tuple[list[bytes], Terminal | None, int]:
    """The complete frames at the start of ``data``: their PCM, the terminal (None: not
    yet), and how many bytes of ``data`` they took (a torn frame after them is left)."""
    view = memoryview(data)
    pcm: list[bytes] = []
    at = 0
    while len(view) - at >= _FRAME.size:
        kind, n = _FRAME.unpack_from(view, at)
        if kind not in (PCM, END, FAILED) or n > MAX_FRAME:
            raise FlightDamaged(f"a frame of kind {kind} and {n} bytes")
        end = at + _FRAME.size + n
        if end > len(view):
            break  # torn: its writer is still at it
        payload = view[at + _FRAME.size : end]
        at = end
        if kind == PCM:
            pcm.append(bytes(payload))
            continue
        try:
            terminal: Terminal = (end_decoder if kind == END else error_decoder).decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise FlightDamaged(f"an undecodable terminal frame: {e}") from None
        return pcm, terminal, at
    return pcm, None, at


def _locked(fd: int, how: int) -> bool:
    """Take ``flock(how | LOCK_NB)`` on ``fd``; False if another open file holds a lock
    that conflicts."""
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _unlink_if(path: Path | str, st: os.stat_result) -> None:
    """Unlink ``path`` if it still names the file ``st`` describes (another leader's file
    may have taken the name since)."""
    with contextlib.suppress(FileNotFoundError):
        now = os.stat(path)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)


def _close(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


class FlightLog:
    """A leader's log, written by one thread in order (``gateway.cache.relay``)."""

    def __init__(self, path: Path, fd: int, join: Path, join_fd: int) -> None:
        self.path = path
        self.join = join
        self._fd: int | None = fd
        self._join_fd: int | None = join_fd
        self._st = os.fstat(fd)
        self._join_st = os.fstat(join_fd)

    @classmethod
    def claim(cls, directory: Path, digest: str) -> FlightLog | None:
        """Lead the unit ``digest``'s flight in ``directory`` (the tenant's): its log, locked;
        None if another leader's log has the name."""
        directory.mkdir(parents=True, exist_ok=True)
        join = directory / (digest + JOIN)
        join_fd = os.open(join, os.O_RDWR | os.O_CREAT, 0o600)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a file nobody else has: at once
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
            os.write(fd, MAGIC)
            os.link(tmp, directory / (digest + FLIGHT))
        except BaseException as e:
            _close(fd)
            _close(join_fd)
            if isinstance(e, FileExistsError):
                return None
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return cls(directory / (digest + FLIGHT), fd, join, join_fd)

    def _write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    def append(self, pcms: list[bytes]) -> None:
        """PCM frames, one write for all of them."""
        self._write(b"".join(pcm_frame(p) for p in pcms))

    def nobody_listens(self) -> bool:
        """True if no follower of another process listens (then none can join until the
        log is ended: the lock is kept)."""
        return self._join_fd is not None and _locked(self._join_fd, fcntl.LOCK_EX)

    def end(self, terminal: Terminal) -> None:
        """The terminal frame, then the log's end: its files unlinked and closed."""
        try:
            self._write(terminal_frame(terminal))
        finally:
            self.close()

    def close(self) -> None:
        """Unlink the files (if still this log's) and close them. A log closed without its
        terminal frame fails its followers (``LEADER_DIED``)."""
        if self._fd is None:
            return
        try:
            _unlink_if(self.path, self._st)  # before the lock goes: see the module docstring
            _unlink_if(self.join, self._join_st)
        finally:
            _close(self._fd)
            _close(self._join_fd)
            self._fd = self._join_fd = None


class Joined(NamedTuple):
    """A flight joined (``FlightReader.open``): the reader, and the PCM written so far."""

    reader: FlightReader
    pcm: list[bytes]


class FlightReader:
    """A follower's view of another process's log: the frames as they come, and the
    leader's liveness. Holds the join file's shared lock until closed."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._join_fd: int | None = None
        self.offset = len(MAGIC)
        """Where the first frame not yet delivered starts."""

    @classmethod
    def open(cls, directory: Path, digest: str) -> Joined | None:
        """Follow the flight of ``digest`` in ``directory``. None: no flight to follow
        (none; or one that ended: its leader's client had its end, a request after it never
        follows it; or its leader is cancelling it or died: a dead leader's log is removed,
        and the caller leads anew)."""
        path = directory / (digest + FLIGHT)
        try:
            fd = os.open(path, os.O_RDONLY)
        except (FileNotFoundError, NotADirectoryError):
            return None
        reader = cls(fd)
        try:
            joined = reader._join(path, directory / (digest + JOIN))
        except BaseException:
            reader.close()
            raise
        if joined is None:
            reader.close()
        return joined

    def _join(self, path: Path, join: Path) -> Joined | None:
        assert self._fd is not None
        if self.leader_gone():
            st = os.fstat(self._fd)
            if st.st_nlink:  # still under its name: left by a leader that died
                _unlink_if(path, st)
            return None  # (unlinked: it ended a moment ago)
        if os.pread(self._fd, len(MAGIC), 0) != MAGIC:
            return None  # not this version's
        try:
            self._join_fd = os.open(join, os.O_RDONLY)
        except FileNotFoundError:
            pass  # the leader ended (its terminal is written) or its tenant was purged
        else:
            if not _locked(self._join_fd, fcntl.LOCK_SH):
                return None  # its leader is cancelling it: nobody listened
        pcm, terminal = self.read()
        if terminal is not None or self._join_fd is None:
            return None  # it ended (or was cancelled), or its tenant was purged: synthesise
        return Joined(self, pcm)

    def read(self) -> tuple[list[bytes], Terminal | None]:
        """The PCM of the frames written since the last read, and the terminal if it came;
        a torn frame is left for the next."""
        assert self._fd is not None
        size = os.fstat(self._fd).st_size
        if size <= self.offset:
            return [], None
        data = os.pread(self._fd, size - self.offset, self.offset)
        pcm, terminal, n = parse(data)
        self.offset += n
        return pcm, terminal

    def leader_gone(self) -> bool:
        """No leader holds the log's lock any more (it ended, or died)."""
        assert self._fd is not None
        if not _locked(self._fd, fcntl.LOCK_SH):
            return False
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        return True

    def close(self) -> None:
        """Close the files (the join file's lock goes with it)."""
        fd, self._fd = self._fd, None
        join_fd, self._join_fd = self._join_fd, None
        _close(fd)
        _close(join_fd)


def remove_if_stale(path: str) -> bool:
    """Remove a flight's file that nobody uses any more (``gateway.cache.node``'s sweep): a
    log no leader locks, a join file whose log is gone and that no follower locks. True if
    removed."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        if path.endswith(FLIGHT):
            if not _locked(fd, fcntl.LOCK_SH):
                return False
        elif os.path.exists(path[: -len(JOIN)] + FLIGHT) or not _locked(fd, fcntl.LOCK_EX):
            return False
        _unlink_if(path, os.fstat(fd))
        return True
    finally:
        _close(fd)
