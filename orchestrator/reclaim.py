"""What a server instance holds in /dev/shm, recorded while it runs, and taken back once the
whole instance is dead.

When one worker dies the supervisor kills what is left of its tree and unlinks what only that
tree mapped (``orchestrator.proctree.kill_tree``); a clean stop unlinks everything. When every
process of the instance dies at once (the OOM killer taking the service's cgroup,
``systemctl kill -s KILL``, a container killed in its pod) nobody is left to do either, and
besides the instance's own rings (``orpheus-<pid>-*``, found by name) it leaves what vLLM,
PyTorch and Python's multiprocessing created in its workers under random names: vLLM's
shared-memory broadcast queues (``multiprocessing.shared_memory``: ``psm_<hex>``) and
multiprocessing's named semaphores (``sem.mp-<random>``), which their resource trackers would
have unlinked had they survived.

Random names cannot be attributed after the fact, so the orchestrator records them while they
are in use: a manifest, ``/dev/shm/orpheus-<pid>-owners``, lists every /dev/shm file that a
process below the orchestrator maps or holds open (name and inode) and the processes seen
holding it (pid and start time). It lives in /dev/shm itself, so it survives exactly as long
as what it describes (a systemd RuntimeDirectory or a container's /tmp does not).

The rule a later start (and ``orpheus-serve cleanup``) applies: an object recorded in a
manifest is unlinked when

1. the manifest's orchestrator is dead (no process with its pid and start time: a reused pid,
   as in a restarted container's new pid namespace, is a different process);
2. every process recorded holding it is dead (pid and start time again);
3. the name still denotes the recorded inode (a name reused since is not ours);
4. no live process maps it or holds it open (by inode, on the whole host).

A file in no manifest is never touched, and nothing of an instance whose orchestrator lives
is, so two servers on one host never clean each other's. Rings and sockets of a dead
instance go by name as before (``shm.segments.remove_stale_instances``). Recorded files that
a live process still holds (a worker of the dead orchestrator still stopping; the CUDA MPS
server, which maps what it shares with its clients) are kept, and the dead instance's
manifest is rewritten to list only those, for a later pass.

Caveat: objects are recorded at each worker's ready and every ``TREE_SNAPSHOT_S`` after; one
created and leaked between two records is not known. vLLM creates its queues as the engine
starts, before the worker reports ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Iterable

import msgspec

from orchestrator import proctree
from shm.layout import SEGMENT_PREFIX, InstanceLayout, pid_alive
from shm.messages import UNDECODABLE
from shm.segments import remove_stale_instances

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = "owners"
_MANIFEST_RE = re.compile(rf"^({re.escape(SEGMENT_PREFIX)}(\d+))-{MANIFEST_SUFFIX}$")
_INSTANCE_RE = re.compile(rf"^({re.escape(SEGMENT_PREFIX)}(\d+))(?:-|$)")


class Owner(msgspec.Struct, frozen=True, array_like=True):
    """A process, by pid and start time (clock ticks since boot): a reused pid differs."""

    pid: int
    start: int

    def alive(self) -> bool:
        return proctree.start_time(self.pid) == self.start


class Held(msgspec.Struct):
    """A /dev/shm file the instance's processes were seen to map or hold open."""

    name: str
    inode: int
    owners: list[Owner]


class Manifest(msgspec.Struct):
    instance: str
    run_dir: str
    """Where the instance's socket directory is (``shm.run_dir`` when it started)."""
    orchestrator: Owner
    objects: list[Held] = []


def manifest_name(instance: str) -> str:
    return f"{instance}-{MANIFEST_SUFFIX}"


def _shm_listing() -> dict[str, os.stat_result]:
    out: dict[str, os.stat_result] = {}
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(proctree.SHM_DIR):
            with contextlib.suppress(OSError):
                if entry.is_file(follow_symlinks=False):
                    out[entry.name] = entry.stat(follow_symlinks=False)
    return out


def _write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Recorder:
    """The orchestrator's record of what its process tree holds in /dev/shm (the manifest).

    ``record`` reads the maps and open files of every process below the orchestrator (the
    workers, vLLM's EngineCore and Workers, the resource trackers: re-parented orphans too,
    the orchestrator being a subreaper) and rewrites the manifest when what it lists changed.
    Files since unlinked drop out of it; the instance's own ``orpheus-<pid>-*`` files are not
    listed (they go by name)."""

    def __init__(self, layout: InstanceLayout, orchestrator: int | None = None) -> None:
        pid = os.getpid() if orchestrator is None else orchestrator
        start = proctree.start_time(pid)
        if start is None:
            raise ProcessLookupError(f"no process {pid}")
        self.path = os.path.join(proctree.SHM_DIR, manifest_name(layout.instance))
        self._instance_prefix = f"{layout.instance}-"
        self._head = (layout.instance, layout.run_dir, Owner(pid, start))
        self._held: dict[tuple[str, int], set[Owner]] = {}
        self._written: bytes | None = None

    def record(self, pids: Iterable[int] | None = None) -> None:
        """Note what ``pids`` (default: every process below the orchestrator) hold now, and
        write the manifest if that changed. Best-effort: an OSError is logged, not raised."""
        if pids is None:
            pids = proctree.descendants([self._head[2].pid])
        held = proctree.shm_inodes(pids)
        listing = _shm_listing()
        by_inode = {st.st_ino: name for name, st in listing.items()}
        starts: dict[int, int | None] = {}
        for inode, holders in held.items():
            name = by_inode.get(inode)
            if name is None or name.startswith(self._instance_prefix):
                continue
            owners = self._held.setdefault((name, inode), set())
            for pid in holders:
                if pid not in starts:
                    starts[pid] = proctree.start_time(pid)
                if (start := starts[pid]) is not None:
                    owners.add(Owner(pid, start))
        for key in [
            k for k in self._held if (st := listing.get(k[0])) is None or st.st_ino != k[1]
        ]:
            del self._held[key]
        self.write()

    def manifest(self) -> Manifest:
        instance, run_dir, orch = self._head
        objects = [
            Held(name, inode, sorted(owners, key=lambda o: o.pid))
            for (name, inode), owners in sorted(self._held.items())
        ]
        return Manifest(instance, run_dir, orch, objects)

    def write(self) -> None:
        data = msgspec.json.encode(self.manifest())
        if data == self._written:
            return
        try:
            _write_atomic(self.path, data)
            self._written = data
        except OSError as exc:
            log.warning("cannot write the shared-memory manifest %s: %s", self.path, exc)


def read_manifests() -> dict[str, Manifest]:
    """Every readable manifest in /dev/shm, by instance (an unreadable one is skipped: that
    instance is judged by its pid alone)."""
    out: dict[str, Manifest] = {}
    with contextlib.suppress(FileNotFoundError):
        names = os.listdir(proctree.SHM_DIR)
    for name in names:
        m = _MANIFEST_RE.match(name)
        if not m:
            continue
        try:
            with open(os.path.join(proctree.SHM_DIR, name), "rb") as f:
                man = msgspec.json.decode(f.read(), type=Manifest)
        except (OSError, *UNDECODABLE):
            continue
        if man.instance == m.group(1):
            out[man.instance] = man
    return out


class Reclaimed(msgspec.Struct):
    """What one pass took back (or, dry, would take back)."""

    instances: list[str]
    """Dead instances that left something."""
    freed: list[tuple[str, int, int]]
    """/dev/shm files unlinked: name, the bytes of memory it held (allocated blocks, as
    ``du`` counts) and its size (as ``ls -l`` shows; vLLM's queues are sparse)."""
    kept: list[str]
    """Recorded files of dead instances left because a live process still holds them."""
    socket_dirs: list[str]
    dry_run: bool = False

    @property
    def freed_bytes(self) -> int:
        return sum(f[1] for f in self.freed)

    @property
    def freed_size(self) -> int:
        return sum(f[2] for f in self.freed)

    def describe(self) -> str:
        verb = "would free" if self.dry_run else "freed"
        if not self.freed and not self.kept and not self.socket_dirs:
            return "reclaim: no dead instance left anything in /dev/shm"
        files = ", ".join(f"{n} {b / 1e6:.1f} MB" if b >= 1e5 else n for n, b, _ in self.freed)
        text = (
            f"reclaim: dead instance(s) {', '.join(self.instances) or 'none'}: {verb} "
            f"{len(self.freed)} file(s) in {proctree.SHM_DIR}, {self.freed_bytes / 1e6:.0f} MB "
            f"of memory ({self.freed_size / 1e6:.0f} MB in size){f': {files}' if files else ''}"
        )
        if self.socket_dirs:
            text += f", {len(self.socket_dirs)} socket dir(s)"
        if self.kept:
            text += f"; kept {len(self.kept)} still held by a live process: {', '.join(self.kept)}"
        return text


def _instance_dead(instance: str, manifests: dict[str, Manifest], starting: str | None) -> bool:
    if instance == starting:
        return True
    man = manifests.get(instance)
    if man is not None:
        return not man.orchestrator.alive()
    m = _INSTANCE_RE.match(instance)
    return m is not None and not pid_alive(int(m.group(2)))


def reclaim(run_dir: str, *, dry_run: bool = False, starting: str | None = None) -> Reclaimed:
    """Take back what dead instances left in /dev/shm (the rule is the module's) and their
    socket directories under ``run_dir``; ``dry_run``: only say what would go.

    ``starting``: the instance the caller is about to create. Whatever already bears its name
    was left by a dead predecessor with the same pid (a restarted container's orchestrator
    often gets its predecessor's pid), even one that died before it wrote its manifest: it
    must go, or creating the rings fails on the existing names."""
    manifests = read_manifests()
    listing = _shm_listing()
    live_inodes: set[int] | None = None
    freed: list[tuple[str, int, int]] = []
    kept: dict[str, list[Held]] = {}
    """Per dead instance, the recorded files a live process still holds: its manifest is
    rewritten to list only those, for a later pass."""
    touched: set[str] = set()
    for instance, man in sorted(manifests.items()):
        if man.orchestrator.alive() and instance != starting:
            continue
        for obj in man.objects:
            st = listing.get(obj.name)
            if st is None or st.st_ino != obj.inode:
                continue  # gone already, or the name is another file's now
            if live_inodes is None:
                live_inodes = set(proctree.shm_inodes(proctree.processes()))
            if obj.inode in live_inodes or any(o.alive() for o in obj.owners):
                kept.setdefault(instance, []).append(obj)
                continue
            if not dry_run:
                try:
                    os.unlink(os.path.join(proctree.SHM_DIR, obj.name))
                except FileNotFoundError:
                    continue
            freed.append((obj.name, st.st_blocks * 512, st.st_size))
            touched.add(instance)

    def dead(instance: str) -> bool:
        return _instance_dead(instance, manifests, starting)

    socket_dirs: list[str] = []
    if dry_run:
        for name, st in sorted(listing.items()):
            if (m := _INSTANCE_RE.match(name)) and dead(m.group(1)):
                freed.append((name, st.st_blocks * 512, st.st_size))
                touched.add(m.group(1))
    else:
        kept_manifests = {manifest_name(i) for i in kept}
        # The instances' own files by name (their manifests among them) and socket dirs.
        for path in remove_stale_instances(run_dir, dead=dead):
            name = os.path.basename(path)
            if os.path.dirname(path) == proctree.SHM_DIR:
                st = listing.get(name)
                if name not in kept_manifests:  # rewritten below
                    freed.append((name, st.st_blocks * 512, st.st_size) if st else (name, 0, 0))
            else:
                socket_dirs.append(path)
            if m := _INSTANCE_RE.match(name):
                touched.add(m.group(1))
        # A dead instance whose sockets were under another shm.run_dir.
        for instance, man in sorted(manifests.items()):
            path = os.path.join(man.run_dir, instance)
            if os.path.isdir(path) and dead(instance):
                shutil.rmtree(path, ignore_errors=True)
                socket_dirs.append(path)
                touched.add(instance)
        for instance, objects in kept.items():
            man = msgspec.structs.replace(manifests[instance], objects=objects)
            with contextlib.suppress(OSError):
                _write_atomic(
                    os.path.join(proctree.SHM_DIR, manifest_name(instance)),
                    msgspec.json.encode(man),
                )
    return Reclaimed(
        sorted(touched | set(kept)),
        freed,
        sorted(o.name for objects in kept.values() for o in objects),
        socket_dirs,
        dry_run,
    )
