"""Process-tree clean-up with real processes (no vLLM): a worker's group and what it forked
die with it, and the shared-memory segments only they had mapped are unlinked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator import proctree

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

# A "worker": leads its own session, forks a grandchild (as vLLM forks its EngineCore) that
# creates a POSIX shared-memory segment the way vLLM's broadcast queue does (registered with
# multiprocessing's resource tracker, itself one more process of the group), then both sleep.
WORKER = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys, time
    from multiprocessing import shared_memory
    sys.path.insert(0, {root!r})
    if {pdeathsig}:
        from orchestrator.child import _die_with_parent
        _die_with_parent()

    def engine(name, ready):
        seg = shared_memory.SharedMemory(name=name, create=True, size=1 << 20)
        seg.buf[:] = b"x" * (1 << 20)  # touch every page: the segment holds real memory
        if {untracked}:  # nobody but the orchestrator's clean-up can unlink it
            from multiprocessing import resource_tracker
            resource_tracker.unregister(seg._name, "shared_memory")
        ready.send(os.getpid())
        time.sleep(600)

    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        a, b = ctx.Pipe()
        # A named semaphore registered with the resource tracker (as vLLM's spawn-context
        # locks are): /dev/shm/sem.mp-*. The tracker starts here, before the fork, so the
        # engine holds its pipe too and it outlives a kill -9 of the worker.
        lock = mp.get_context("spawn").Lock()
        p = ctx.Process(target=engine, args=({name!r}, b))
        p.start()
        print(a.recv(), lock._semlock.name, flush=True)
        time.sleep(600)
    """
)


def _start_worker(
    tmp: Path, name: str, *, pdeathsig: bool, untracked: bool = False
) -> tuple[subprocess.Popen[str], int, str]:
    script = tmp / "worker.py"
    script.write_text(
        WORKER.format(root=str(ROOT), name=name, pdeathsig=pdeathsig, untracked=untracked)
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    engine_pid, sem = proc.stdout.readline().split()
    return proc, int(engine_pid), "sem." + sem.lstrip("/")


def _wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proctree.alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def segment_name() -> Iterator[str]:
    name = f"psm_test_{os.getpid()}_{os.urandom(3).hex()}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


@pytest.mark.parametrize("untracked", [False, True], ids=["tracked", "untracked"])
def test_kill_tree_after_kill_9_kills_the_orphans_and_frees_their_segment(
    tmp_path: Path, segment_name: str, untracked: bool
) -> None:
    """tracked: the resource tracker, killed last, unlinks what was registered with it;
    untracked: kill_tree unlinks the segment the dead tree had mapped."""
    proc, engine_pid, sem = _start_worker(
        tmp_path, segment_name, pdeathsig=False, untracked=untracked
    )
    try:
        tree = {proc.pid} | proctree.descendants([proc.pid])
        assert engine_pid in tree and len(tree) >= 3, "worker, engine and resource tracker"
        assert segment_name in proctree.shm_mappings(tree)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # The failure the issue measured: the engine outlives its worker, segment and all.
        time.sleep(0.3)
        assert proctree.alive(engine_pid)
        assert os.path.exists(f"/dev/shm/{segment_name}")
        assert os.path.exists(f"/dev/shm/{sem}")

        trackers = {p for p in tree if proctree.is_resource_tracker(p)}
        result = proctree.kill_tree(proc.pid)
        assert engine_pid in result.killed and result.survivors == []
        # The tracker read its pipe's EOF once the engine was gone and exited by itself within
        # its grace: it is not among the killed (after a clean stop that is the whole tree).
        assert len(trackers) == 1 and not trackers & set(result.killed), (trackers, result)
        assert not proctree.alive(engine_pid)
        assert all(not proctree.alive(p) for p in tree)
        assert not os.path.exists(f"/dev/shm/{segment_name}")
        assert not os.path.exists(f"/dev/shm/{sem}"), "the semaphore is unlinked too"
        if untracked:
            assert result.unlinked == [segment_name] and result.freed_bytes >= 1 << 20
        # Unlinked and mapped or held open by no process on the host: its pages are freed.
        # (Not /dev/shm's total bytes: another pytest-xdist worker's server may write there.)
        everyone = [int(d) for d in os.listdir("/proc") if d.isdigit()]
        assert segment_name not in proctree.shm_mappings(everyone)
    finally:
        proctree.kill_tree(proc.pid)


def test_kill_tree_keeps_segments_still_mapped_elsewhere_and_the_keep_prefix(
    tmp_path: Path, segment_name: str
) -> None:
    from multiprocessing import shared_memory

    proc, _, _ = _start_worker(tmp_path, segment_name, pdeathsig=False, untracked=True)
    mine = shared_memory.SharedMemory(name=segment_name)  # this process maps it too
    try:
        result = proctree.kill_tree(proc.pid)
        assert result.unlinked == [], "a segment a live process maps is not unlinked"
        assert os.path.exists(f"/dev/shm/{segment_name}")
    finally:
        mine.close()
        proctree.kill_tree(proc.pid)
    proc.wait()

    proc2, _, _ = _start_worker(tmp_path, segment_name + "b", pdeathsig=False, untracked=True)
    try:
        result = proctree.kill_tree(proc2.pid, keep_prefix=segment_name)
        assert result.unlinked == [] and os.path.exists(f"/dev/shm/{segment_name}b")
    finally:
        proctree.kill_tree(proc2.pid)
        proc2.wait()
        os.unlink(f"/dev/shm/{segment_name}b")


def test_children_forked_by_a_worker_die_with_it(tmp_path: Path, segment_name: str) -> None:
    """orchestrator.child's at-fork hook: a forked engine gets SIGTERM when its worker dies,
    even when no orchestrator is left to clean up."""
    proc, engine_pid, _ = _start_worker(tmp_path, segment_name, pdeathsig=True)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _wait_dead(engine_pid, 10), "the forked engine died with its worker"
    finally:
        proctree.kill_tree(proc.pid)


def test_subreaper_adopts_orphans_and_reaps_them(tmp_path: Path) -> None:
    script = tmp_path / "reaper.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys, time
            sys.path.insert(0, {str(ROOT)!r})
            from orchestrator import proctree
            assert proctree.become_subreaper()
            mid = subprocess.Popen([sys.executable, "-c",
                "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
                "'import time; time.sleep(600)']); print(p.pid, flush=True)"],
                stdout=subprocess.PIPE, text=True)
            orphan = int(mid.stdout.readline())
            mid.wait()
            time.sleep(0.2)
            assert proctree.read_proc(orphan).ppid == os.getpid(), "adopted"
            assert proctree.orphans([mid.pid]) == {{orphan}}
            os.kill(orphan, 9)
            time.sleep(0.2)
            assert proctree.reap_orphans([mid.pid]) == [orphan]
            assert proctree.read_proc(orphan) is None, "reaped, not a zombie"
            print("ok")
            """
        )
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_read_proc_reads_pid_ppid_pgid_and_state() -> None:
    me = proctree.read_proc(os.getpid())
    assert me is not None and me.ppid == os.getppid() and me.pgid == os.getpgrp()
    assert me.state in "RS"
    assert proctree.read_proc(2**22 + 12345) is None


def test_a_process_spawned_by_a_worker_is_protected_too(tmp_path: Path) -> None:
    """multiprocessing "spawn" (vLLM's EngineCore and Workers on this build) imports the
    worker's main module, orchestrator.child, as __mp_main__: that import gives the spawned
    process PDEATHSIG and tolerant stdio (its tqdm bar on a full log disk killed the engine's
    start at every restart)."""
    script = tmp_path / "spawned.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import ctypes, runpy, signal, sys
            sys.path.insert(0, {str(ROOT)!r})
            runpy.run_module("orchestrator.child", run_name="__mp_main__")
            from orchestrator.logs import TolerantStream
            assert isinstance(sys.stderr, TolerantStream) and isinstance(sys.stdout, TolerantStream)
            sig = ctypes.c_int()
            ctypes.CDLL("libc.so.6").prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG
            assert sig.value == signal.SIGTERM, sig.value
            from tqdm import tqdm
            for _ in tqdm(range(3), desc="Loading safetensors checkpoint shards"):
                pass
            print("ok", file=sys.stderr)
            """
        )
    )
    with open("/dev/full", "wb") as full:
        r = subprocess.run([sys.executable, str(script)], stdout=full, stderr=full, timeout=60)
    assert r.returncode == 0


def test_kill_tree_does_not_count_a_zombie_as_killed() -> None:
    """A process of the tree that had exited and was not yet reaped (a worker's resource
    tracker that exited as the worker stopped) is dead already: not among the killed, so a
    clean stop is not reported as processes left behind."""
    code = "import os, time\nif os.fork() == 0: os._exit(0)\nprint(flush=True)\ntime.sleep(600)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        proc.stdout.readline()
        deadline = time.monotonic() + 10
        while not (zombies := sorted(proctree.descendants([proc.pid]))):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        while proctree.alive(zombies[0]):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        result = proctree.kill_tree(proc.pid)
        assert result.killed == [proc.pid] and result.survivors == [], result
    finally:
        proc.kill()
        proc.wait()


# A worker that would outlive its orchestrator: it ignores SIGTERM (as a worker stuck in a
# drain or in a library's shutdown would) and has forked a process of its own group.
STUCK_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    sys.path.insert(0, {root!r})
    from common.config import ServeConfig
    from orchestrator import child
    from shm.layout import InstanceLayout

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()
    layout = InstanceLayout.for_pid(parent, run_dir={run_dir!r}, gateways=1)
    spec = child.ChildSpec(config=ServeConfig(), layout=layout, parent_pid=parent)
    forked = os.fork()
    if forked == 0:
        time.sleep(600)
        os._exit(0)
    child._end_when_orphaned_too_long(spec, "codec", {grace_s})
    print(forked, flush=True)
    time.sleep(600)
    """
)
ORCHESTRATOR = textwrap.dedent(
    """
    import subprocess, sys, time
    with open({log!r}, "wb") as log:
        worker = subprocess.Popen([sys.executable, {script!r}], stdout=subprocess.PIPE,
                                  stderr=log, start_new_session=True)
    print(worker.pid, worker.stdout.readline().decode().strip(), flush=True)
    time.sleep(600)
    """
)


def test_a_worker_that_outlives_its_orchestrator_is_ended_after_the_grace(
    tmp_path: Path,
) -> None:
    """kill -9 of the orchestrator: a worker that does not stop on the SIGTERM that follows
    is ended ORPHAN_GRACE_S later by its own watchdog, with its group, and says so in one
    line (CI at e2a15dc: one process of a killed server was still alive 60 s later)."""
    script, log = tmp_path / "worker.py", tmp_path / "worker.log"
    grace_s = 1.0
    script.write_text(STUCK_WORKER.format(root=str(ROOT), run_dir=str(tmp_path), grace_s=grace_s))
    orch = tmp_path / "orchestrator.py"
    orch.write_text(ORCHESTRATOR.format(log=str(log), script=str(script)))
    proc = subprocess.Popen([sys.executable, str(orch)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    worker, forked = (int(p) for p in proc.stdout.readline().split())
    try:
        time.sleep(2 * grace_s)
        assert proctree.alive(worker), "the watchdog waits for the orchestrator's death"
        t0 = time.monotonic()
        proc.kill()
        proc.wait()
        assert _wait_dead(worker, 30) and _wait_dead(forked, 10)
        assert time.monotonic() - t0 >= grace_s
        text = log.read_text()
        assert text.count("still running") == 1 and "ending it" in text, text
    finally:
        proctree.kill_tree(-1, extra=[worker, forked], timeout_s=5)
        proc.kill()
        proc.wait()


def test_wait_exit_returns_once_the_process_is_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    t0 = time.monotonic()
    proctree.wait_exit(proc.pid)  # the exit makes a zombie until reaped: exited all the same
    assert time.monotonic() - t0 >= 0.2
    proc.wait()
    proctree.wait_exit(2**22 + 12345)  # no such process: at once
