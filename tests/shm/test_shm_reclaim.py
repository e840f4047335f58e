"""The reclaim rule of ``orchestrator.reclaim`` (issue 47), without an engine: real processes
that create what vLLM's do (``multiprocessing.shared_memory`` segments ``psm_*``, a spawn
context's named semaphore ``sem.mp-*``, both registered with a resource tracker), killed as a
whole group (their resource tracker with them, so nothing unlinks them), as a crash of the
whole server would.

/dev/shm is shared with whatever else runs on the machine: every assertion is about files
these tests made, by name and inode. A reclaim takes back every dead instance's files, so two
of these tests at once take each other's: they run one at a time across pytest-xdist workers
(``shm_reclaim_lock``, tests/conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from e2e_harness import present

from orchestrator import proctree
from orchestrator.reclaim import (
    Held,
    Manifest,
    Owner,
    Recorder,
    manifest_name,
    read_manifests,
    reclaim,
)
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.ring import SHM_DIR
from shm.segments import create_instance, destroy_instance

pytestmark = pytest.mark.usefixtures("shm_reclaim_lock")

SMALL = ShmConfig(code_ring_bytes=64 << 10, pcm_ring_bytes=256 << 10)

HOLDER = textwrap.dedent("""
    import multiprocessing, sys, time
    from multiprocessing import shared_memory
    seg = shared_memory.SharedMemory(create=True, size=1 << 20)
    seg.buf[:: 4096] = b"x" * len(seg.buf[:: 4096])  # pages allocated: real memory
    lock = multiprocessing.get_context("spawn").Lock()
    print("ready", flush=True)
    time.sleep(600)
""")


class Holder:
    """A process in its own session holding a ``psm_*`` segment and a ``sem.mp-*`` semaphore
    (and, as in vLLM's processes, a resource tracker that would unlink them at its exit)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.pid = self.proc.pid
        self.files = held_files([self.pid])

    def kill_all(self) -> None:
        """SIGKILL the whole session at once (the holder and its resource tracker)."""
        tree = {self.pid} | proctree.descendants([self.pid])
        for pid in tree:
            os.kill(pid, signal.SIGSTOP)  # none of them acts on another's death
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 10
        while any(proctree.alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)


def held_files(pids: list[int]) -> dict[str, int]:
    """/dev/shm names (and inodes) that the processes and their descendants map or hold."""
    tree = set(pids) | proctree.descendants(pids)
    inodes = proctree.shm_inodes(tree)
    return {e.name: e.inode() for e in os.scandir(SHM_DIR) if e.inode() in inodes}


def _unlink(names: Iterator[str] | set[str] | list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    made: list[Holder] = []
    yield made
    for h in made:
        if h.proc.poll() is None:
            h.kill_all()
        _unlink(h.files)


@pytest.fixture
def run_dir(tmp_path: Path) -> str:
    return str(tmp_path)


def test_a_holder_leaves_vllms_kinds_of_file_when_killed_as_a_whole(
    holders: list[Holder],
) -> None:
    """The premise: what the holders make is what vLLM leaves, and a whole-group kill leaves it."""
    h = Holder()
    holders.append(h)
    assert any(n.startswith("psm_") for n in h.files), h.files
    # glibc maps the semaphore under a temporary name it unlinked at once: found by inode.
    assert any(n.startswith("sem.mp-") for n in h.files), h.files
    h.kill_all()
    assert present(h.files) == set(h.files), "nothing unlinked them"


def test_a_dead_instance_is_reclaimed_and_a_live_one_beside_is_untouched(
    holders: list[Holder], run_dir: str
) -> None:
    dead, live = Holder(), Holder()
    holders += [dead, live]
    layouts = [InstanceLayout.for_pid(h.pid, run_dir, gateways=1) for h in (dead, live)]
    for h, lay in zip((dead, live), layouts, strict=True):
        create_instance(lay, SMALL)
        Recorder(lay, orchestrator=h.pid).record([h.pid])
    dead_lay, live_lay = layouts
    unrelated = f"psm_reclaim_test_{os.urandom(4).hex()}"
    with open(os.path.join(SHM_DIR, unrelated), "wb") as f:
        f.write(b"\0" * 4096)  # nobody's record mentions it, nobody holds it
    try:
        man = read_manifests()[dead_lay.instance]
        assert {o.name for o in man.objects} == set(dead.files)
        assert all(o.owners == [Owner(dead.pid, proctree.start_time(dead.pid) or 0)]
                   for o in man.objects)  # fmt: skip
        dead.kill_all()

        dry = reclaim(run_dir, dry_run=True)
        assert {f[0] for f in dry.freed} >= set(dead.files)
        assert present(dead.files) == set(dead.files), "a dry run unlinks nothing"

        r = reclaim(run_dir)
        assert present(dead.files) == set(), "the dead instance's psm_* and sem.mp-* are gone"
        assert not any(n.startswith(f"{dead_lay.instance}-") for n in os.listdir(SHM_DIR))
        assert not os.path.exists(dead_lay.socket_dir)
        assert dead_lay.instance in r.instances and live_lay.instance not in r.instances
        assert {f[0] for f in r.freed} >= set(dead.files) | {manifest_name(dead_lay.instance)}
        psm = next(n for n in dead.files if n.startswith("psm_"))
        held, size = next(f[1:] for f in r.freed if f[0] == psm)
        assert held >= 1 << 20 and size >= 1 << 20, "the memory it held is counted"
        assert f"{dead_lay.instance}" in r.describe() and psm in r.describe()

        assert present(live.files) == set(live.files), "the live instance's files are kept"
        assert os.path.exists(os.path.join(SHM_DIR, manifest_name(live_lay.instance)))
        assert os.path.exists(os.path.join(SHM_DIR, live_lay.pcm_ring(0).segment))
        assert os.path.exists(live_lay.socket_dir)
        assert os.path.exists(os.path.join(SHM_DIR, unrelated)), "an unrecorded file is kept"
    finally:
        _unlink([unrelated])
        for lay in layouts:
            destroy_instance(lay)


def test_an_object_still_held_by_a_live_process_is_kept(
    holders: list[Holder], run_dir: str
) -> None:
    """The orchestrator died, but the recorded owner lives on (a worker still stopping): the
    object and the instance stay, until the owner is dead and no live process holds it."""
    orch, worker = Holder(), Holder()
    holders += [orch, worker]
    lay = InstanceLayout.for_pid(orch.pid, run_dir, gateways=1)
    create_instance(lay, SMALL)
    try:
        Recorder(lay, orchestrator=orch.pid).record([worker.pid])
        orch.kill_all()
        r = reclaim(run_dir)
        assert present(worker.files) == set(worker.files), "its owner lives"
        assert set(r.kept) == set(worker.files) and lay.instance in r.instances
        assert os.path.exists(os.path.join(SHM_DIR, manifest_name(lay.instance))), "kept whole"

        worker.kill_all()
        psm = next(n for n in worker.files if n.startswith("psm_"))
        fd = os.open(os.path.join(SHM_DIR, psm), os.O_RDONLY)  # a live process holds it
        try:
            r = reclaim(run_dir)
            assert present(worker.files) == {psm} and r.kept == [psm]
        finally:
            os.close(fd)
        r = reclaim(run_dir)
        assert present(worker.files) == set() and r.kept == []
        assert not any(n.startswith(f"{lay.instance}-") for n in os.listdir(SHM_DIR))
    finally:
        destroy_instance(lay)


def test_a_reused_orchestrator_pid_does_not_keep_a_dead_instance_alive(
    holders: list[Holder], run_dir: str
) -> None:
    """A restarted container's new processes get the old pids again (a new pid namespace):
    the pid of the dead orchestrator runs another process, which the start time tells."""
    dead, reuser = Holder(), Holder()
    holders += [dead, reuser]
    lay = InstanceLayout.for_pid(reuser.pid, run_dir, gateways=1)
    create_instance(lay, SMALL)
    try:
        rec = Recorder(lay, orchestrator=reuser.pid)
        rec.record([dead.pid])
        man = rec.manifest()
        stale = msgspec.structs.replace(
            man, orchestrator=Owner(reuser.pid, man.orchestrator.start - 1)
        )  # the dead orchestrator had the same pid and started earlier
        with open(os.path.join(SHM_DIR, manifest_name(lay.instance)), "wb") as f:
            f.write(msgspec.json.encode(stale))
        dead.kill_all()
        reclaim(run_dir)
        assert present(dead.files) == set()
        assert not os.path.exists(os.path.join(SHM_DIR, lay.pcm_ring(0).segment))
        assert present(reuser.files) == set(reuser.files), "the process with the pid now"
    finally:
        destroy_instance(lay)


def test_the_record_follows_what_is_held(holders: list[Holder], run_dir: str) -> None:
    """Files unlinked since drop out of the manifest; the instance's own rings are not in it
    (they go by name); a live instance's manifest keeps its orchestrator's identity."""
    h = Holder()
    holders.append(h)
    lay = InstanceLayout.for_pid(h.pid, run_dir, gateways=1)
    create_instance(lay, SMALL)
    try:
        rec = Recorder(lay, orchestrator=h.pid)
        rec.record([h.pid])
        assert {o.name for o in rec.manifest().objects} == set(h.files)
        h.kill_all()
        _unlink(h.files)
        rec.record([])
        assert rec.manifest().objects == []
        with open(os.path.join(SHM_DIR, manifest_name(lay.instance)), "rb") as f:
            assert msgspec.json.decode(f.read(), type=Manifest) == rec.manifest()
    finally:
        destroy_instance(lay)


def test_a_record_is_trusted_no_further_than_it_goes(holders: list[Holder], run_dir: str) -> None:
    """A live recorded holder keeps a file even when nobody maps it (a named semaphore between
    uses); a recorded name that now denotes another file (another inode) is not ours."""
    orch = Holder()
    holders.append(orch)
    orch_start = proctree.start_time(orch.pid) or 0
    orch.kill_all()
    instance = f"orpheus-{orch.pid}"
    tag = os.urandom(4).hex()
    names = {k: f"psm_reclaim_test_{tag}_{k}" for k in ("held", "renamed", "dead")}
    inodes = {}
    for key, name in names.items():
        with open(os.path.join(SHM_DIR, name), "wb") as f:
            f.write(b"\0" * 4096)
        inodes[key] = os.stat(os.path.join(SHM_DIR, name)).st_ino
    me = Owner(os.getpid(), proctree.start_time(os.getpid()) or 0)
    gone = Owner(orch.pid, orch_start)
    man = Manifest(instance, run_dir, gone, [
        Held(names["held"], inodes["held"], [me]),  # alive, though it maps nothing now
        Held(names["renamed"], inodes["renamed"] + 1, [gone]),  # the name is another file's
        Held(names["dead"], inodes["dead"], [gone]),
    ])  # fmt: skip
    with open(os.path.join(SHM_DIR, manifest_name(instance)), "wb") as f:
        f.write(msgspec.json.encode(man))
    try:
        r = reclaim(run_dir)
        assert [f[0] for f in r.freed if f[0].startswith("psm_reclaim_test")] == [names["dead"]]
        assert r.kept == [names["held"]]
        assert os.path.exists(os.path.join(SHM_DIR, names["held"]))
        assert os.path.exists(os.path.join(SHM_DIR, names["renamed"]))
        assert not os.path.exists(os.path.join(SHM_DIR, names["dead"]))
        kept = read_manifests()[instance]
        assert [o.name for o in kept.objects] == [names["held"]], "the record shrinks to it"
    finally:
        _unlink([*names.values(), manifest_name(instance)])


def test_a_start_removes_what_bears_its_own_name(holders: list[Holder], run_dir: str) -> None:
    """A restarted container's orchestrator can get its dead predecessor's pid: files under
    its own instance name, even without a manifest, are the predecessor's, and must go before
    it creates its rings (which refuse existing names)."""
    h = Holder()  # stands for this start's orchestrator: alive, and the pid is its own
    holders.append(h)
    lay = InstanceLayout.for_pid(h.pid, run_dir, gateways=1)
    create_instance(lay, SMALL)  # the predecessor's rings, no manifest
    ring = os.path.join(SHM_DIR, lay.pcm_ring(0).segment)
    try:
        reclaim(run_dir)
        assert os.path.exists(ring), "a live pid without a record is a live instance"
        r = reclaim(run_dir, starting=lay.instance)
        assert not os.path.exists(ring) and not os.path.exists(lay.socket_dir)
        assert lay.instance in r.instances
        create_instance(lay, SMALL)
    finally:
        destroy_instance(lay)
