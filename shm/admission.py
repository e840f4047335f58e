"""Node-wide admission counters in the instance's shared memory.

With ``gateway.processes > 1`` the gateway processes admit streams against one set of limits
(``max_active_streams``, ``max_queued_streams``) for the whole node, so that ``GET /ready``
and the 429s of any gateway say what the node can take. The segment
``/dev/shm/<instance>-admission`` holds one 256-byte slot per gateway process::

    slot i:  pid i64 | active i64 | queued i64 | oldest_wait_ns i64
             | active on engine 0..7: 8 x i64 | learned limit of engine 0..7: 8 x i64
             | (96 bytes unused)
             | per-key table: KEY_ENTRIES x (key id i64 | active i64 | queued i64
                                             | refused i64 | last admitted ns i64
                                             | admitted lately i64 | slotless i64)

The per-engine counts place each stream on one of the node's vLLM engines (``llm.engines``)
by the streams every gateway holds there, so two gateways do not pile onto one engine. The
learned limits (``gateway.admission = "learned"``) are each gateway's opinion of what each
engine holds in real time (0: no fresh evidence); the node takes the lowest fresh one.
The per-key table holds the streams (active and queued) each API key has in this gateway,
the requests of the key it refused lately whose clients are still expected back (their
Retry-After not yet out), when it last admitted one of the key's streams and how many it
admitted lately, and its streams that hold no engine slot (the sentence audio cache's hits:
counted in the key's concurrency, not in its share), under a stable
63-bit id of the key (``key_id``; 0 marks a free entry), so that a key's concurrency limit
(``gateway.max_streams_per_key``), its fair share of the node (``gateway.admission.shares``) and the
turns between keys are the node's, not one process's. A gateway publishes its ``KEY_ENTRIES`` busiest keys; one with more
keys at once counts the rest only locally (``Published.keys_left``).

A slot is written only by its gateway (``index``), and only while that gateway holds an
exclusive ``flock`` on the segment, so that "count the node, then take a slot" is atomic
across processes (two syscalls, held for microseconds). All zeros is the empty state: the
orchestrator creates the segment zero-filled, a gateway claims its slot at start and zeroes
it at exit. A gateway killed without zeroing its slot (SIGKILL) is detected by its pid: a
slot whose pid is not alive counts as empty and is zeroed by the next gateway that looks.
The lock dies with its holder (flock locks belong to the open file), so a killed gateway
cannot wedge the others. ``oldest_wait_ns`` (CLOCK_MONOTONIC, one clock for every process)
of each gateway's oldest queued request lets the gateways serve their queues in node-wide
arrival order.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import NamedTuple

import numpy as np

from shm.layout import MAX_ENGINES, pid_alive
from shm.ring import SHM_DIR

HEADER_BYTES = 256
KEY_ENTRIES = 128
"""API keys one gateway publishes at once (7 KiB of its slot)."""
KEY_FIELDS = 7
"""Key id, active, queued, refused, last admitted (CLOCK_MONOTONIC ns), admitted lately,
slotless."""
SLOT_BYTES = HEADER_BYTES + KEY_ENTRIES * KEY_FIELDS * 8
_FIELDS = SLOT_BYTES // 8
PID, ACTIVE, QUEUED, OLDEST = 0, 1, 2, 3
ENGINE0 = 4
"""Index of engine 0's count in a slot; engine ``e``'s is ``ENGINE0 + e``."""
LIMIT0 = ENGINE0 + MAX_ENGINES
"""Index of engine 0's learned limit in a slot."""
KEYS0 = HEADER_BYTES // 8
"""Index of the per-key table in a slot: entry ``k`` is ``KEYS0 + 5k .. KEYS0 + 5k + 4``."""


class KeyCounts(NamedTuple):
    """A key's streams in one gateway (or, merged, in several)."""

    active: int = 0
    queued: int = 0
    refused: int = 0
    """Its requests refused lately whose clients are expected back (demand not served)."""
    last_admit_ns: int = 0
    """When one of its streams was last admitted (CLOCK_MONOTONIC; 0: not lately)."""
    admitted: int = 0
    """Its streams admitted lately (``gateway.admission.queue.ADMITTED_WINDOW_S``): its turns."""
    slotless: int = 0
    """Its streams that hold no engine slot (the sentence audio cache's hits): they count
    in its concurrency (``gateway.max_streams_per_key``), not in ``active`` nor its share."""

    def merged(self, other: KeyCounts) -> KeyCounts:
        return KeyCounts(
            self.active + other.active,
            self.queued + other.queued,
            self.refused + other.refused,
            max(self.last_admit_ns, other.last_admit_ns),
            self.admitted + other.admitted,
            self.slotless + other.slotless,
        )


NO_COUNTS = KeyCounts()


def key_id(key: str) -> int:
    """The key's id on the board: stable across processes (``hash()`` is salted per process),
    positive and never 0 (a free entry). Keys are not stored, only this digest."""
    n = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
    return n or 1


def segment_bytes(slots: int) -> int:
    return max(mmap.PAGESIZE, slots * SLOT_BYTES)


def create_admission_segment(segment: str, slots: int) -> None:
    """Create the zero-filled segment (the orchestrator does, with the rings)."""
    fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(slots))
    finally:
        os.close(fd)


def unlink_admission_segment(segment: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, segment))


class Others(NamedTuple):
    """What the other gateway processes of the node hold."""

    active: int
    queued: int
    oldest_wait_ns: int
    """Arrival time of their oldest queued request (0: none queued)."""
    oldest_index: int
    """Index of the gateway holding that request (ties go to the lower index)."""
    by_engine: tuple[int, ...] = (0,) * MAX_ENGINES
    """Their active streams on each engine."""
    limits: tuple[int, ...] = (0,) * MAX_ENGINES
    """The lowest learned limit of each engine among them (0: none has an opinion)."""
    keys: Mapping[int, KeyCounts] = {}
    """Their counts of the keys asked for (``others(keys=...)``; all of them with
    ``every=True``) by key id; a key they hold, queue and refused none of is absent."""


NOBODY = Others(0, 0, 0, -1)


class AdmissionBoard:
    """One gateway's handle on the node's admission segment."""

    def __init__(self, segment: str, slots: int, index: int) -> None:
        if not 0 <= index < slots:
            raise ValueError(f"gateway index {index} outside 0..{slots - 1}")
        self.index = index
        self._fd = os.open(os.path.join(SHM_DIR, segment), os.O_RDWR)
        try:
            size = segment_bytes(slots)
            if os.fstat(self._fd).st_size < size:
                raise ValueError(f"admission segment {segment} is smaller than {size} bytes")
            self._mm = mmap.mmap(self._fd, size)
        except BaseException:
            os.close(self._fd)
            raise
        self._slots = np.ndarray((slots, _FIELDS), dtype=np.int64, buffer=self._mm)
        self._locked = False
        with self.locked():
            self._slots[index] = 0
            self._slots[index, PID] = os.getpid()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the node's admission lock (not re-entrant; never held across an await)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        self._locked = True
        try:
            yield
        finally:
            self._locked = False
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def others(self, keys: Iterable[int] = (), *, every: bool = False) -> Others:
        """The other gateways' counts (lock held), with those of the key ids ``keys`` (every
        key they publish with ``every``). Slots of dead processes are zeroed."""
        assert self._locked, "others() needs the lock"
        wanted = np.fromiter(keys, dtype=np.int64)
        counts: dict[int, KeyCounts] = {}
        active = queued = 0
        oldest, oldest_index = 0, -1
        by_engine = np.zeros(MAX_ENGINES, dtype=np.int64)
        limits = np.zeros(MAX_ENGINES, dtype=np.int64)
        for i, slot in enumerate(self._slots):
            if i == self.index:
                continue
            pid = int(slot[PID])
            if pid == 0:
                continue
            if not pid_alive(pid):
                self._slots[i] = 0
                continue
            active += int(slot[ACTIVE])
            queued += int(slot[QUEUED])
            by_engine += slot[ENGINE0 : ENGINE0 + MAX_ENGINES]
            theirs = slot[LIMIT0 : LIMIT0 + MAX_ENGINES]
            limits = np.where((theirs > 0) & ((limits == 0) | (theirs < limits)), theirs, limits)
            t = int(slot[OLDEST])
            if t and (oldest == 0 or t < oldest):
                oldest, oldest_index = t, i
            if wanted.size or every:
                table = slot[KEYS0:].reshape(KEY_ENTRIES, KEY_FIELDS)
                rows = table[table[:, 0] != 0] if every else table[np.isin(table[:, 0], wanted)]
                for kid, a, q, r, t, n, f in rows.tolist():
                    theirs = KeyCounts(a, q, r, t, n, f)
                    held = counts.get(kid)
                    counts[kid] = theirs if held is None else held.merged(theirs)
        return Others(
            active,
            queued,
            oldest,
            oldest_index,
            tuple(int(n) for n in by_engine),
            tuple(int(n) for n in limits),
            counts,
        )

    def publish(
        self,
        active: int,
        queued: int,
        oldest_wait_ns: int,
        by_engine: tuple[int, ...] = (),
        limits: tuple[int, ...] = (),
        keys: Mapping[int, KeyCounts] | None = None,
    ) -> int:
        """Write this gateway's counts (lock held); ``by_engine``: its active streams on
        each engine (engines beyond it: none); ``limits``: its learned limit of each engine
        (0 or missing: no opinion); ``keys``: its ``KeyCounts`` (or their first fields) by key
        id (None: leave the table as it is). Returns how many keys did not fit (``KEY_ENTRIES``; the
        busiest are published)."""
        assert self._locked, "publish() needs the lock"
        slot = self._slots[self.index]
        slot[ACTIVE] = active
        slot[QUEUED] = queued
        slot[OLDEST] = oldest_wait_ns
        engines = slot[ENGINE0 : ENGINE0 + MAX_ENGINES]
        engines[:] = 0
        engines[: len(by_engine)] = by_engine
        opinions = slot[LIMIT0 : LIMIT0 + MAX_ENGINES]
        opinions[:] = 0
        opinions[: len(limits)] = limits
        if keys is None:
            return 0
        table = slot[KEYS0:].reshape(KEY_ENTRIES, KEY_FIELDS)
        table[:] = 0
        rows = list(keys.items())
        if len(rows) > KEY_ENTRIES:
            rows.sort(key=lambda kv: kv[1][0] + kv[1][1] + kv[1][2] + sum(kv[1][5:]), reverse=True)
        for k, (kid, counts) in enumerate(rows[:KEY_ENTRIES]):
            table[k, 0] = kid
            table[k, 1 : 1 + len(counts)] = counts
        return max(0, len(rows) - KEY_ENTRIES)

    def close(self) -> None:
        """Give this gateway's slot back (its streams are over) and unmap. Idempotent."""
        if self._fd < 0:
            return
        with self.locked():
            self._slots[self.index] = 0
        del self._slots
        self._mm.close()
        os.close(self._fd)
        self._fd = -1
