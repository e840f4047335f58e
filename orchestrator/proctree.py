"""Process trees of the workers: find what a worker started, kill all of it, free its segments.

Each worker runs in its own session, so its process group id is its pid, and vLLM's
``EngineCore`` / ``Worker`` processes (forked or spawned by the llm worker), their
multiprocessing resource tracker and any compile workers belong to that group. When a worker
dies, however it died (kill -9 included), the orchestrator kills what is left of its group
before it restarts it, and unlinks the POSIX shared-memory segments (vLLM's ``psm_*``
broadcast queues) that only those processes had mapped: a SIGKILLed process never unlinks
anything, and the resource tracker that would have done so dies with the group.

The orchestrator is also a child subreaper (``PR_SET_CHILD_SUBREAPER``): a process whose
parent dies is re-parented to the orchestrator instead of init, so even a process that left
its worker's group stays in reach (:func:`reap_orphans`).

Linux only (``/proc``); everything here is best-effort against races with exiting processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import select
import signal
import time
from collections.abc import Iterable

import msgspec

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
TRACKER_GRACE_S = 2.0


class Proc(msgspec.Struct, frozen=True):
    pid: int
    ppid: int
    pgid: int
    sid: int
    """Session id: a worker leads its own session, and what it starts stays in it."""
    state: str
    """One letter from /proc/<pid>/stat: R, S, D, T (stopped), Z (zombie) ..."""


class TreeKill(msgspec.Struct, frozen=True):
    """What :func:`kill_tree` did."""

    killed: list[int]
    unlinked: list[str]
    freed_bytes: int
    survivors: list[int]

    def describe(self) -> str:
        text = f"killed {len(self.killed)} process(es)"
        if self.unlinked:
            text += f", unlinked {len(self.unlinked)} segment(s) ({self.freed_bytes / 1e6:.0f} MB)"
        if self.survivors:
            text += f"; still alive: {self.survivors}"
        return text


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


def set_pdeathsig(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies."""
    libc = _libc()
    return libc is not None and libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def wait_exit(pid: int, poll_s: float = 0.5) -> None:
    """Block until process ``pid`` has exited (a zombie counts): on a pidfd where the kernel
    has them (Linux 5.3+), so the waiting thread sleeps in the kernel; else by polling."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):
        while alive(pid):
            time.sleep(poll_s)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def become_subreaper() -> bool:
    """Orphaned descendants of this process are re-parented to it (not to init)."""
    libc = _libc()
    return libc is not None and libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (field 3 on), None if
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself hold spaces or parentheses.
    return raw[raw.rfind(")") + 2 :].split()


def read_proc(pid: int) -> Proc | None:
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        return Proc(
            pid=pid, ppid=int(fields[1]), pgid=int(fields[2]), sid=int(fields[3]), state=fields[0]
        )
    except (IndexError, ValueError):
        return None


def processes() -> dict[int, Proc]:
    out: dict[int, Proc] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (p := read_proc(int(name))) is not None:
            out[p.pid] = p
    return out


def descendants(roots: Iterable[int], table: dict[int, Proc] | None = None) -> set[int]:
    """Every process below ``roots`` (the roots excluded)."""
    table = processes() if table is None else table
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out: set[int] = set()
    todo = list(roots)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def alive(pid: int) -> bool:
    """Running or stopped; a zombie is dead."""
    p = read_proc(pid)
    return p is not None and p.state != "Z"


def shm_mappings(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files the processes have mapped or open (names, not paths)."""
    names: set[str] = set()
    prefix = SHM_DIR + "/"
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(prefix)
                    if i >= 0:
                        names.add(line[i + len(prefix) :].strip().removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith(prefix):
                        names.add(target[len(prefix) :].removesuffix(" (deleted)"))
    return {n for n in names if n and "/" not in n}


def start_time(pid: int) -> int | None:
    """When the process started, in clock ticks since boot (``/proc/<pid>/stat`` field 22):
    with the pid, an identity that a reused pid does not share. None if there is no such
    process (or it is a zombie: dead)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    try:
        return None if fields[0] == "Z" else int(fields[19])
    except (IndexError, ValueError):
        return None


def shm_inodes(pids: Iterable[int]) -> dict[int, set[int]]:
    """The /dev/shm files the processes map or hold open, by inode: ``{inode: {pid, ...}}``.

    By inode, not name: glibc's ``sem_open`` creates a semaphore under a temporary name
    (``sem.XXXXXX``), maps it, links it to its real name (``sem.mp-...``) and unlinks the
    temporary one, so the process's maps name a deleted file while the semaphore lives on
    under another name. The inode is the file's, whatever name it was opened by."""
    out: dict[int, set[int]] = {}
    prefix = " " + SHM_DIR + "/"
    try:
        shm_dev = os.stat(SHM_DIR).st_dev
    except OSError:
        return out
    for pid in pids:
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if prefix in line:
                        # address perms offset dev inode path
                        with contextlib.suppress(IndexError, ValueError):
                            out.setdefault(int(line.split(None, 5)[4]), set()).add(pid)
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                    if st.st_dev == shm_dev:
                        out.setdefault(st.st_ino, set()).add(pid)
    return out


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    """Wait until the processes are dead (reaping our own); those still alive at the end."""
    deadline = time.monotonic() + timeout_s
    pending = set(pids)
    while pending:
        for pid in list(pending):
            _reap(pid)  # our own children (and orphans re-parented to us) become zombies
            if not alive(pid):
                pending.discard(pid)
        if not pending or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    return pending


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker (``...resource_tracker import main;main(fd)``)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def kill_tree(
    pgid: int,
    *,
    keep_prefix: str = "",
    exclude: Iterable[int] = (),
    extra: Iterable[int] = (),
    timeout_s: float = 10.0,
    tracker_grace_s: float | None = TRACKER_GRACE_S,
) -> TreeKill:
    """SIGKILL every process of group ``pgid`` and below it (and ``extra`` and below), then
    unlink the /dev/shm segments that only they had mapped.

    ``exclude``: pids never touched (the caller itself, a live worker). ``keep_prefix``:
    segment names never unlinked (the instance's own rings, which outlive a worker).

    multiprocessing's resource trackers are killed last: once every other process is gone,
    a tracker reads EOF and unlinks what was registered with it and never unlinked (named
    semaphores ``sem.mp-*``, which nobody maps between uses, and shared memory), then exits by
    itself. It gets ``tracker_grace_s`` for that, and is among the result's ``killed`` only
    where it had to be killed; None spares trackers (the caller still holds their pipe: they
    exit after it).
    """
    me = os.getpid()
    skip = {me, *exclude}
    table = processes()
    roots = {p.pid for p in table.values() if p.pgid == pgid} | set(extra)
    victims = (roots | descendants(roots, table)) - skip
    victims = {pid for pid in victims if pid in table}
    # Already dead, only not yet reaped (a tracker that exited as its worker stopped, now
    # re-parented to us): reaped where ours, never counted as killed.
    for pid in [pid for pid in victims if table[pid].state == "Z"]:
        _reap(pid)
        victims.discard(pid)
    segments = {s for s in shm_mappings(victims) if not (keep_prefix and s.startswith(keep_prefix))}
    trackers = {pid for pid in victims if is_resource_tracker(pid)}
    if tracker_grace_s is None:
        victims -= trackers
        trackers = set()
    for pid in sorted(victims - trackers):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    pending = _wait_gone(victims - trackers, timeout_s)
    left: set[int] = set()
    if trackers:
        left = _wait_gone(trackers, tracker_grace_s or 0.0) if not pending else trackers
        for pid in sorted(left):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        pending |= _wait_gone(left, timeout_s)
    unlinked: list[str] = []
    freed = 0
    if segments:
        # Only what no surviving process still maps (another instance's, a live worker's).
        survivors = set(processes()) - victims
        still_used = shm_mappings(survivors)
        for name in sorted(segments - still_used):
            path = os.path.join(SHM_DIR, name)
            with contextlib.suppress(OSError):
                st = os.stat(path)
                os.unlink(path)
                unlinked.append(name)
                freed += st.st_blocks * 512
    # A tracker that exited by itself within its grace was not killed: after a clean stop the
    # worker's tracker is still reading its pipe's EOF when the caller looks.
    killed = (victims - trackers) | left
    return TreeKill(
        killed=sorted(killed), unlinked=unlinked, freed_bytes=freed, survivors=sorted(pending)
    )


def orphans(tracked: Iterable[int]) -> set[int]:
    """Processes re-parented to this (subreaper) process that it did not start itself."""
    me = os.getpid()
    keep = set(tracked)
    return {p.pid for p in processes().values() if p.ppid == me and p.pid not in keep}


def reap_orphans(tracked: Iterable[int]) -> list[int]:
    """Collect the exit status of dead orphans (zombies re-parented to us)."""
    reaped: list[int] = []
    for pid in orphans(tracked):
        p = read_proc(pid)
        if p is not None and p.state == "Z":
            _reap(pid)
            reaped.append(pid)
    return reaped


def worker_sessions(orchestrator: int) -> set[int]:
    """The sessions of an orchestrator's workers (each leads its own: session id = its pid)."""
    return {p.pid for p in processes().values() if p.ppid == orchestrator and p.sid == p.pid}


def instance_processes(orchestrator: int, sessions: Iterable[int] | None = None) -> list[int]:
    """Live processes of the server whose orchestrator is ``orchestrator``: itself, everything
    below it, and everything in its workers' sessions (``sessions``, default: the sessions of
    its children now), which holds vLLM's EngineCore and Workers and the resource trackers
    even once re-parented. Pass the sessions noted earlier to look after the orchestrator died.

    (Not by environment or command line: setproctitle, which the workers and vLLM's processes
    call, overwrites both in /proc.)"""
    table = processes()
    sess = (
        set(sessions)
        if sessions is not None
        else {p.pid for p in table.values() if p.ppid == orchestrator and p.sid == p.pid}
    )
    out = {p.pid for p in table.values() if p.sid in sess}
    if orchestrator in table:
        out |= {orchestrator} | descendants([orchestrator], table)
    return sorted(pid for pid in out if table.get(pid) and table[pid].state != "Z")


def shm_bytes() -> int:
    """Bytes /dev/shm holds (allocated blocks, as ``du`` counts them)."""
    total = 0
    for name in os.listdir(SHM_DIR):
        with contextlib.suppress(OSError):
            total += os.stat(os.path.join(SHM_DIR, name)).st_blocks * 512
    return total
