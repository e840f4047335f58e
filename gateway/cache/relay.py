"""A single flight across the node's gateway processes, on the event loop's side
(``gateway.cache.flight`` is the disk's): a leader's audio to its log, in order and off the
loop (``FlightRelay``), and another process's flight as a stream of this one's, its twins'
leader here (``FlightTail``). ``gateway.requests`` decides who leads and who follows.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gateway.cache.flight import LEADER_DIED, FlightDamaged, FlightLog, Joined, Terminal
from gateway.streams import PcmStream
from shm.records import StreamEnd, StreamError

POLL_S = 0.01
"""A follower's look at a log that had no new bytes: this often (and at the leader's lock)."""

Failed = Callable[[str, BaseException], None]
"""Counts and logs a disk error (``AudioCache``'s)."""


class FlightWrites:
    """Every chunk this process's leaders push, handed to the flight thread in batches: one
    per process, shared by its ``FlightRelay``s. A leader pushes one chunk per codec window
    (85 ms), so a queue per leader would take one chunk a drain: a thread hand-off, a future
    and a write per chunk of every miss (scripts/dev/flight_relay_cost.py: 0.21 s of CPU per
    second at 500 streams). Here a push appends to one queue; one drain at a time is handed
    to the thread, and it takes every chunk queued when it runs, all leaders', each leader's
    in one write."""

    def __init__(self, io: ThreadPoolExecutor) -> None:
        self._io = io
        self._queued: deque[tuple[FlightRelay, bytes]] = deque()
        """Chunks pushed that no drain has taken yet (the loop appends, the thread pops:
        each atomic)."""
        self._draining = False
        """A drain is handed to the thread and has not started taking chunks: a push needs
        no other. The thread clears it before it takes them, so a chunk pushed after that
        is taken by a drain of its own, never left behind."""

    def submit(self, fn: Callable[..., Any], *args: object) -> Future[Any] | None:
        """``fn(*args)`` in the flight thread, after everything handed to it before; None
        once the cache closed (nothing is written any more)."""
        try:
            return self._io.submit(fn, *args)
        except RuntimeError:
            return None

    def push(self, relay: FlightRelay, data: bytes) -> None:
        self._queued.append((relay, data))
        if not self._draining:
            self._draining = True
            self.submit(self.drain)

    def drain(self) -> None:
        """In the flight thread: write what is queued, each relay's chunks in order."""
        self._draining = False  # before the chunks are taken: see ``_draining``
        queued = self._queued
        batch: dict[FlightRelay, list[bytes]] = {}
        for _ in range(len(queued)):
            relay, data = queued.popleft()
            batch.setdefault(relay, []).append(data)
        for relay, pcms in batch.items():
            relay.append(pcms)


class FlightRelay:
    """A leader's stream's audio, then its end, to the flight's log (``PcmStream.relay``).
    Every disk call runs in the flight thread (one: the log's frames in order, never behind
    an entry's fsync or a sweep), none on the loop; a failing disk ends the log without its
    terminal (its followers fail: ``LEADER_DIED``) and never the leader. Its chunks go
    through the process's ``FlightWrites``."""

    def __init__(self, writes: FlightWrites, directory: Path, digest: str, failed: Failed) -> None:
        self._writes = writes
        self._submit = writes.submit
        self._failed = failed
        self._log: FlightLog | None = None
        """The flight thread's: the log, None once ended, or if another process leads."""
        self.ended = False
        """The loop's: the end was sent."""
        self._submit(self._claim, directory, digest)

    # -- on the loop: what ``PcmStream`` tells it ------------------------------------------
    def push(self, data: bytes) -> None:
        if not self.ended:
            self._writes.push(self, data)

    def done(self, terminal: Terminal, then: Callable[[], None] | None = None) -> None:
        """The leader's stream ended (``StreamEnd``) or failed; told once. ``then``: called
        on the loop once the log is ended (at once if it cannot be)."""
        if self.ended:
            return
        self.ended = True
        fut = self._submit(self._end, terminal)
        if then is None:
            return
        if fut is None:
            then()
            return
        loop = asyncio.get_running_loop()
        fut.add_done_callback(lambda _: loop.call_soon_threadsafe(then))

    def listened(self, then: Callable[[bool], None]) -> None:
        """Ask whether a follower of another process listens (after the frames queued before
        the question); ``then(listens)`` on the loop. No log (another process leads, the
        disk failed): nobody."""
        fut = self._submit(self._nobody_listens)
        if fut is None:
            then(False)
            return
        loop = asyncio.get_running_loop()

        def answered(f: Future[bool]) -> None:
            listens = not f.cancelled() and f.exception() is None and not f.result()
            loop.call_soon_threadsafe(then, listens)

        fut.add_done_callback(answered)

    # -- in the flight thread ----------------------------------------------------------------
    def _claim(self, directory: Path, digest: str) -> None:
        try:
            self._log = FlightLog.claim(directory, digest)
        except OSError as e:
            self._failed("a flight's log", e)

    def append(self, pcms: list[bytes]) -> None:
        """In the flight thread (``FlightWrites.drain``): frames of this log, in order."""
        log = self._log
        if log is None or not pcms:
            return
        try:
            log.append(pcms)
        except OSError as e:
            self._failed("a flight's log", e)
            self._log = None
            with contextlib.suppress(OSError):
                log.close()

    def _end(self, terminal: Terminal) -> None:
        self._writes.drain()  # the chunks pushed before the end that no drain took yet
        log, self._log = self._log, None
        if log is None:
            return
        try:
            log.end(terminal)
        except OSError as e:
            self._failed("a flight's log", e)

    def _nobody_listens(self) -> bool:
        log = self._log
        if log is None:
            return True
        try:
            return log.nobody_listens()
        except OSError:
            return True


class FlightTail:
    """Another process's flight as ``stream`` (a proxy: no client of its own, its followers
    are this process's twins), fed by a task that reads the log as it grows: complete frames
    only, the terminal's end or failure, ``LEADER_DIED`` if the leader let go of its lock
    without one. ``on_end`` is told once, when it stops; the reader is closed then."""

    def __init__(
        self, joined: Joined, stream: PcmStream, on_end: Callable[[FlightTail], None]
    ) -> None:
        self.reader = joined.reader
        self.stream = stream
        self._on_end: Callable[[FlightTail], None] | None = on_end
        stream.orphan()  # nobody reads it: its followers get each chunk
        stream.record = []
        stream.followers = []
        self._deliver(joined.pcm, None)
        self._task = asyncio.create_task(self._run(), name="flight-tail")

    def _deliver(self, pcm: list[bytes], terminal: Terminal | None) -> None:
        stream = self.stream
        if pcm:
            stream.last_record_at = asyncio.get_running_loop().time()
            for chunk in pcm:
                stream.push(chunk)
        if isinstance(terminal, StreamEnd):
            stream.finish(terminal)
        elif terminal is not None:
            stream.fail(terminal, discard_pending=False)

    async def _run(self) -> None:
        stream, reader = self.stream, self.reader
        try:
            # Reads on the loop: the bytes the leader wrote a moment ago, in the page cache
            # (a read costs microseconds; the log's first bytes were read off the loop).
            while not stream.done:
                pcm, terminal = reader.read()
                self._deliver(pcm, terminal)
                if stream.done or stream.followers == []:
                    break  # ended, or its last follower left
                if not pcm:
                    if reader.leader_gone():
                        pcm, terminal = reader.read()  # what it wrote before it let go
                        self._deliver(pcm, terminal)
                        if not stream.done:
                            stream.fail(LEADER_DIED, discard_pending=False)
                        break
                    await asyncio.sleep(POLL_S)
        except (FlightDamaged, OSError) as e:
            stream.fail(
                StreamError("flight_damaged", f"the flight's log cannot be read: {e}", 502),
                discard_pending=False,
            )
        finally:
            self._stopped()

    def _stopped(self) -> None:
        self.reader.close()
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end(self)

    def stop(self) -> None:
        """Stop reading (its last follower left, or the gateway closes): the files closed now
        (the join lock goes with them), the task cancelled."""
        self._task.cancel()
        self._stopped()
