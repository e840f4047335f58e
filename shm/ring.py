"""Single-producer single-consumer ring of variable-size records in POSIX shared memory.

Layout of a segment (all integers little-endian, 64-bit fields 8-byte aligned)::

    0    magic u64 | capacity u64                     (written once by create_ring)
    64   head u64  (bytes ever published by the producer)  | producer_waiting u32
    128  tail u64  (bytes ever released by the consumer)   | consumer_sleeping u32
    256  data area of `capacity` bytes (a multiple of 8)

A record is a 24-byte header ``(length u32, kind u16, flags u16, stream_id u64, seq u64)``
followed by ``length`` payload bytes, padded to a multiple of 8. A record never wraps: when
it does not fit before the end of the data area the producer writes a WRAP marker (kind 0)
and continues at offset 0. ``head`` and ``tail`` only grow, so ``head - tail`` is the used
space and full/empty are never ambiguous.

Ordering: the producer copies payloads, then stores ``head`` with one aligned 8-byte store;
the consumer loads ``head`` before reading payloads. x86-64 (TSO) keeps stores ordered with
stores and loads with loads, which is all this needs. The one reordering TSO allows (a store
followed by a load of another address) can delay a doorbell: the consumer stores "sleeping"
then loads ``head`` while the producer stores ``head`` then loads "sleeping". Both may read
the old value in a window of nanoseconds; the consumer's timed recheck (``recheck_ms``)
bounds the cost of that lost doorbell. On weakly ordered CPUs (aarch64) the payload/head
ordering would additionally need a release/acquire fence: this module is x86-64 only.

Signalling (docs/architecture.md, *Signalling*): each ring has two ZeroMQ doorbells. ``data_bell`` (consumer
binds PULL) is rung by the producer after a publish, only when the consumer has said it is
going to sleep; ``space_bell`` (producer binds PULL) is rung by the consumer after a release,
only when the producer has said it waits for space.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import numpy as np
import zmq
import zmq.asyncio

from shm.layout import RingEndpoints

MAGIC = 0x4F52504845555331  # "ORPHEUS1"
HEADER_BYTES = 256
RECORD_HEADER = struct.Struct("<IHHQQ")
RECORD_HEADER_BYTES = RECORD_HEADER.size  # 24
WRAP_KIND = 0
_WRAP_MARKER = struct.Struct("<IHH")
_OFF_MAGIC, _OFF_CAPACITY = 0, 8
_OFF_HEAD, _OFF_PRODUCER_WAITING = 64, 72
_OFF_TAIL, _OFF_CONSUMER_SLEEPING = 128, 136
SHM_DIR = "/dev/shm"

Payload = bytes | bytearray | memoryview | np.ndarray


class RingFull(Exception):
    """The consumer did not free enough space before the producer's timeout."""


class Record(NamedTuple):
    kind: int
    stream_id: int
    seq: int
    payload: memoryview
    """Zero-copy view into the ring: valid until the reader's next ``release()``."""


def _align8(n: int) -> int:
    return (n + 7) & ~7


def record_bytes(payload_len: int) -> int:
    """Space one record takes in the data area."""
    return _align8(RECORD_HEADER_BYTES + payload_len)


def segment_path(segment: str) -> str:
    return os.path.join(SHM_DIR, segment)


def create_ring(ep: RingEndpoints, capacity_bytes: int) -> None:
    """Create and initialise the segment; fails if it already exists (names are per instance).

    Every page of the segment is allocated now (``posix_fallocate``), not as the write
    position first reaches it: the instance's /dev/shm use is flat from the start, and a
    /dev/shm too small for the rings fails here, at start-up, instead of killing a worker with
    SIGBUS on a write mid-stream hours later.
    """
    capacity = _align8(capacity_bytes)
    if capacity < 4096:
        raise ValueError(f"ring capacity {capacity_bytes} is below the 4096-byte minimum")
    path = segment_path(ep.segment)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, HEADER_BYTES + capacity)
        except OSError as e:
            os.unlink(path)
            raise OSError(
                e.errno,
                f"cannot allocate the {(HEADER_BYTES + capacity) / (1 << 20):.1f} MiB ring "
                f"{ep.segment} in {SHM_DIR} ({e.strerror}): make /dev/shm larger "
                "(Docker: --shm-size) or the rings smaller (shm.*_ring_bytes)",
            ) from e
        with mmap.mmap(fd, HEADER_BYTES + capacity) as mm:
            struct.pack_into("<QQ", mm, _OFF_MAGIC, MAGIC, capacity)
    finally:
        os.close(fd)


def unlink_ring(ep: RingEndpoints) -> None:
    try:
        os.unlink(segment_path(ep.segment))
    except FileNotFoundError:
        pass


class _Segment:
    """An attached segment and typed views of its control words."""

    def __init__(self, segment: str) -> None:
        fd = os.open(segment_path(segment), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, capacity = struct.unpack_from("<QQ", self.mm, _OFF_MAGIC)
        if magic != MAGIC or capacity + HEADER_BYTES != size:
            self.mm.close()
            raise ValueError(f"shared-memory segment {segment!r} is not an orpheus-serve ring")
        self.capacity: int = capacity
        self.head = ctypes.c_uint64.from_buffer(self.mm, _OFF_HEAD)
        self.tail = ctypes.c_uint64.from_buffer(self.mm, _OFF_TAIL)
        self.producer_waiting = ctypes.c_uint32.from_buffer(self.mm, _OFF_PRODUCER_WAITING)
        self.consumer_sleeping = ctypes.c_uint32.from_buffer(self.mm, _OFF_CONSUMER_SLEEPING)
        self.data = memoryview(self.mm)[HEADER_BYTES:]

    def close(self) -> None:
        # ctypes views and the memoryview export the buffer: drop them before closing it.
        del self.head, self.tail, self.producer_waiting, self.consumer_sleeping
        self.data.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # a caller still holds a record view: the mapping goes with the last view


def _bind_bell(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 16)
    sock.bind(endpoint)
    return sock


def _connect_bell(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    # A doorbell carries no data: if a few are queued already, dropping more loses nothing.
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.connect(endpoint)
    return sock


def _ring(sock: zmq.Socket) -> None:
    try:
        sock.send(b"", zmq.NOBLOCK)
    except zmq.Again:
        pass  # the peer already has doorbells queued (or is not there yet): it will recheck


def _drain(sock: zmq.Socket) -> None:
    try:
        while True:
            sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        pass


class _Bell:
    """The receiving side of a doorbell, usable from blocking code and from asyncio."""

    def __init__(self, endpoint: str) -> None:
        self.sock = _bind_bell(zmq.Context.instance(), endpoint)

    def wait(self, timeout_s: float) -> bool:
        if self.sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            _drain(self.sock)
            return True
        return False

    async def wait_async(self, timeout_s: float) -> bool:
        """Wait on the socket's file descriptor with the event loop's own reader.

        ZeroMQ's FD is edge-triggered and only says "look at EVENTS", so EVENTS is checked
        before sleeping and after each wake-up. This costs a few microseconds per wait,
        against ~60 us for pyzmq's asyncio poller (measured in the gateway's profile).
        """
        sock = self.sock
        if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            _drain(sock)
            return True
        loop = asyncio.get_running_loop()
        fd = sock.getsockopt(zmq.FD)
        pending: list[asyncio.Future[None]] = [loop.create_future()]
        expired = False

        def wake() -> None:
            if not pending[0].done():
                pending[0].set_result(None)

        def expire() -> None:
            # A flag, not a clock comparison: uvloop may fire a timer slightly before its
            # deadline by loop.time(), and a re-armed wait would then never time out.
            nonlocal expired
            expired = True
            wake()

        loop.add_reader(fd, wake)
        timer = loop.call_later(max(0.0, timeout_s), expire)
        try:
            while True:
                await pending[0]
                if sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    _drain(sock)
                    return True
                if expired:
                    return False
                pending[0] = loop.create_future()  # a spurious edge: wait for the next one
        finally:
            loop.remove_reader(fd)
            timer.cancel()

    def close(self) -> None:
        self.sock.close(linger=0)


class _Sleeping:
    """The consumer's "sleeping" flag of each of its rings, set while it sleeps on their
    doorbells (their producers ring only then): the one place that sets and clears it."""

    __slots__ = ("segs",)

    def __init__(self, segs: Sequence[_Segment]) -> None:
        self.segs = segs

    def __enter__(self) -> None:
        for seg in self.segs:
            seg.consumer_sleeping.value = 1

    def __exit__(self, *_exc: object) -> None:
        for seg in self.segs:
            seg.consumer_sleeping.value = 0


def _wait_for_data(
    has_data: Callable[[], bool],
    sleeping: _Sleeping,
    sleep: Callable[[float], object],
    spin_s: float,
    recheck_s: float,
    timeout_s: float,
) -> bool:
    """Block until ``has_data``: spin ``spin_s``, then sleep on the doorbells (``sleep(s)``
    returns when one rang or after ``s``), rechecking every ``recheck_s`` (a doorbell can be
    lost: see the module's *Ordering*). False after ``timeout_s``."""
    if has_data():
        return True
    spin_end = time.perf_counter() + min(spin_s, timeout_s)
    while time.perf_counter() < spin_end:
        if has_data():
            return True
    deadline = time.monotonic() + timeout_s
    with sleeping:
        while not has_data():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            sleep(min(left, recheck_s))
        return True


class RingWriter:
    """The producer side. Stage records with ``try_append``; ``publish`` makes them visible."""

    def __init__(self, ep: RingEndpoints, *, recheck_ms: int = 20) -> None:
        self.endpoints = ep
        self._seg = _Segment(ep.segment)
        self._space_bell = _Bell(ep.space_bell)
        self._data_bell = _connect_bell(zmq.Context.instance(), ep.data_bell)
        self._recheck_s = recheck_ms / 1000
        self._staged_head = self._seg.head.value  # head including staged, unpublished records
        self.capacity = self._seg.capacity
        self.max_payload = self.capacity // 2 - RECORD_HEADER_BYTES

    # -- staging ---------------------------------------------------------------------------
    def free_bytes(self) -> int:
        return self.capacity - (self._staged_head - self._seg.tail.value)

    def try_append(self, kind: int, stream_id: int, seq: int, payload: Payload) -> bool:
        """Stage one record after the previously staged ones. False if the ring has no room."""
        view = memoryview(payload).cast("B")
        n = view.nbytes
        if n > self.max_payload:
            raise ValueError(f"record payload of {n} bytes exceeds the ring's {self.max_payload}")
        size = record_bytes(n)
        cap = self.capacity
        pos = self._staged_head % cap
        to_end = cap - pos
        need = size if size <= to_end else to_end + size
        if self.capacity - (self._staged_head - self._seg.tail.value) < need:
            return False
        data = self._seg.data
        if size > to_end:
            # Records are 8-aligned, so at least the 8 bytes of (length, kind, flags) fit here.
            _WRAP_MARKER.pack_into(data, pos, 0, WRAP_KIND, 0)
            self._staged_head += to_end
            pos = 0
        RECORD_HEADER.pack_into(data, pos, n, kind, 0, stream_id, seq)
        start = pos + RECORD_HEADER_BYTES
        data[start : start + n] = view
        self._staged_head += size
        return True

    def publish(self) -> None:
        """Make every staged record visible with one store; ring the doorbell if needed."""
        if self._staged_head == self._seg.head.value:
            return
        self._seg.head.value = self._staged_head
        if self._seg.consumer_sleeping.value:
            _ring(self._data_bell)

    # -- blocking helpers ------------------------------------------------------------------
    def append(
        self, kind: int, stream_id: int, seq: int, payload: Payload, timeout_s: float
    ) -> None:
        """Stage a record, publishing and waiting for space while the ring is full."""
        if self.try_append(kind, stream_id, seq, payload):
            return
        for wait_s in self._space_waits(kind, stream_id, seq, payload, timeout_s):
            self._space_bell.wait(wait_s)

    async def append_async(
        self, kind: int, stream_id: int, seq: int, payload: Payload, timeout_s: float
    ) -> None:
        """``append`` for an event loop: the wait for space awaits instead of blocking."""
        if self.try_append(kind, stream_id, seq, payload):
            return
        for wait_s in self._space_waits(kind, stream_id, seq, payload, timeout_s):
            await self._space_bell.wait_async(wait_s)

    def _space_waits(
        self, kind: int, stream_id: int, seq: int, payload: Payload, timeout_s: float
    ) -> Iterator[float]:
        """A full ring's tries, shared by ``append`` and ``append_async`` (each waits its own
        way): publish what is staged, then the seconds to wait for space (at most a recheck)
        before each new try, until the record is staged. Raises ``RingFull`` once it stayed
        full for ``timeout_s``. ``producer_waiting`` asks the consumer for a space doorbell
        while the producer waits, and is cleared when it stops waiting."""
        self.publish()
        deadline = time.monotonic() + timeout_s
        while True:
            self._seg.producer_waiting.value = 1
            if self.try_append(kind, stream_id, seq, payload):
                self._seg.producer_waiting.value = 0
                return
            left = deadline - time.monotonic()
            if left <= 0:
                self._seg.producer_waiting.value = 0
                raise RingFull(f"ring {self.endpoints.segment} stayed full for {timeout_s:.3f}s")
            yield min(left, self._recheck_s)

    def close(self) -> None:
        self._data_bell.close(linger=0)
        self._space_bell.close()
        self._seg.close()


class RingReader:
    """The consumer side: ``poll`` returns zero-copy records, ``release`` frees them."""

    def __init__(self, ep: RingEndpoints, *, spin_us: int = 50, recheck_ms: int = 20) -> None:
        self.endpoints = ep
        self._seg = _Segment(ep.segment)
        self._data_bell = _Bell(ep.data_bell)
        self._space_bell = _connect_bell(zmq.Context.instance(), ep.space_bell)
        self._spin_s = spin_us / 1e6
        self._recheck_s = recheck_ms / 1000
        self._read = self._seg.tail.value  # position after the last record handed out
        self.capacity = self._seg.capacity
        self._sleeping = _Sleeping((self._seg,))

    def used_bytes(self) -> int:
        return self._seg.head.value - self._seg.tail.value

    def has_data(self) -> bool:
        return self._seg.head.value != self._read

    def poll(self, max_records: int = 4096) -> list[Record]:
        """Records published since the last poll (at most ``max_records``), in order."""
        head = self._seg.head.value
        pos = self._read
        if pos == head:
            return []
        cap = self.capacity
        data = self._seg.data
        unpack = RECORD_HEADER.unpack_from
        out: list[Record] = []
        append = out.append
        n = 0
        # Hot loop (every record of every consumer): locals only, no helper calls.
        while pos < head and n < max_records:
            off = pos % cap
            length, kind, _flags, stream_id, seq = (
                unpack(data, off) if cap - off >= RECORD_HEADER_BYTES else (0, WRAP_KIND, 0, 0, 0)
            )
            if kind == WRAP_KIND:
                pos += cap - off
                continue
            start = off + RECORD_HEADER_BYTES
            append(Record(kind, stream_id, seq, data[start : start + length]))
            pos += (RECORD_HEADER_BYTES + length + 7) & ~7
            n += 1
        self._read = pos
        return out

    def release(self) -> None:
        """Give back the space of every record returned so far (their views become invalid)."""
        if self._seg.tail.value == self._read:
            return
        self._seg.tail.value = self._read
        if self._seg.producer_waiting.value:
            _ring(self._space_bell)

    def wait(self, timeout_s: float) -> bool:
        """Block until data may be ready: spin ``spin_us``, then sleep on the doorbell."""
        return _wait_for_data(
            self.has_data, self._sleeping, self._data_bell.wait,
            self._spin_s, self._recheck_s, timeout_s,
        )  # fmt: skip

    async def wait_async(self, timeout_s: float) -> bool:
        """Like ``wait`` for an asyncio consumer (no spin: the event loop has other work)."""
        if self.has_data():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        with self._sleeping:
            while not self.has_data():
                left = deadline - loop.time()
                if left <= 0:
                    return False
                await self._data_bell.wait_async(min(left, self._recheck_s))
            return True

    def close(self) -> None:
        self._space_bell.close(linger=0)
        self._data_bell.close()
        self._seg.close()


class ReaderGroup:
    """Several rings with one consumer (the codec worker reads every engine's code ring):
    one ``wait`` sleeps until any of them has data, on all their doorbells at once."""

    def __init__(self, readers: list[RingReader]) -> None:
        self.readers = readers
        self._poller = zmq.Poller()
        for r in readers:
            self._poller.register(r._data_bell.sock, zmq.POLLIN)
        self._sleeping = _Sleeping([r._seg for r in readers])
        self._spin_s = max((r._spin_s for r in readers), default=0.0)
        self._recheck_s = min((r._recheck_s for r in readers), default=0.05)

    def has_data(self) -> bool:
        for r in self.readers:  # a loop, not any(<generator>): a third of the time
            if r.has_data():
                return True
        return False

    def wait(self, timeout_s: float) -> bool:
        """Block until a ring may have data: spin, then sleep on every doorbell (each ring's
        ``sleeping`` flag set, as ``RingReader.wait`` does for one)."""
        return _wait_for_data(
            self.has_data, self._sleeping, self._sleep, self._spin_s, self._recheck_s, timeout_s
        )

    def _sleep(self, timeout_s: float) -> None:
        for sock, _ in self._poller.poll(max(0, int(timeout_s * 1000))):
            _drain(sock)
