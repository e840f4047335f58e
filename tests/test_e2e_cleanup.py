"""No process and no shared memory outlives a fault (issue 12), on the real server: vLLM on
CPU with the tiny model, started without --codec-model (it finds model/snac).

One server, its log on a small tmpfs that the tests fill up (every later log write fails with
ENOSPC): kill -9 of the llm worker (crash-and-recover cycles: the vLLM EngineCore and Worker
processes die with it, their psm_* segments are unlinked, RSS and /dev/shm come back), a hung
codec worker (SIGSTOP: the heartbeat timeout kills and restarts it), kill -9 of the codec
worker, then SIGTERM: exit 0 and nothing of the instance left. A second server for kill -9 of
the orchestrator itself.

Every wait is bounded; the measured figures are printed (`-s`). E2E_CRASH_CYCLES sets the
number of llm-worker crash cycles (3 by default: each is a vLLM start on CPU).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_harness import (
    Server,
    child_pid,
    instance_pids,
    rss_bytes,
    start_server,
    stop_server,
    wait_no_instance_pids,
)

from bench.doubles.local_server import wait_ready
from bench.load.soak import instance_segments, segment_bytes
from orchestrator import proctree
from shm.ring import SHM_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(3600)]

CYCLES = int(os.environ.get("E2E_CRASH_CYCLES", "3"))
HEARTBEAT_TIMEOUT_S = 20
LOG_DISK_BYTES = 4 << 20
RSS_GROWTH_LIMIT = 1.25
"""Node RSS after the crash cycles over before: allocator and page-cache noise stays below."""


@pytest.fixture(scope="module")
def log_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A small tmpfs for the server's log (a real disk that fills up), else a plain dir."""
    path = tmp_path_factory.mktemp("logdisk")
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={LOG_DISK_BYTES}", "tmpfs", str(path)],
            capture_output=True, check=False,
        ).returncode
        == 0
    )  # fmt: skip
    yield path
    if mounted:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _speak(url: str, frames: int = 6) -> int:
    body = json.dumps({"model": "tts-1", "input": "After the fault.", "voice": "tara",
                       "response_format": "pcm", "max_tokens": 7 * frames, "seed": 3}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/audio/speech", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        assert r.status == 200
        return len(r.read())


def _wait_dead(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while (left := {p for p in pids if proctree.alive(p)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _wait_gone(names: set[str], timeout_s: float) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = {n for n in names if os.path.exists(os.path.join(SHM_DIR, n))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _kill_all(pids: list[int]) -> None:
    """After a failed test: kill what is left, and free the segments only it mapped."""
    if pids:
        proctree.kill_tree(-1, extra=pids)


def _wait_restarted(orch: int, role: str, old: int, timeout_s: float) -> int:
    """The pid of the role's new process, once the orchestrator has started it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = child_pid(orch, role)
        except AssertionError:  # none yet (backoff)
            pid = old
        if pid != old:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"{role} was not restarted within {timeout_s:.0f}s")


class Node:
    """The server and what the tests measured on it."""

    def __init__(self, srv: Server, log_path: Path, shm_before: int) -> None:
        self.srv = srv
        self.log_path = log_path
        self.shm_before = shm_before
        self.seen_segments: set[str] = set()
        self.sessions: set[int] = set()
        """Every worker session seen (a restarted worker leads a new one)."""

    @property
    def instance(self) -> str:
        return self.srv.instance

    def pids(self) -> list[int]:
        if self.srv.proc.poll() is None:
            self.sessions |= proctree.worker_sessions(self.srv.proc.pid)
        return instance_pids(self.instance, self.sessions)

    def note_segments(self) -> set[str]:
        segs = instance_segments(self.instance, self.pids())
        self.seen_segments |= segs
        return segs


@pytest.fixture(scope="module")
def node(tiny_model: Path, log_disk: Path) -> Iterator[Node]:
    shm_before = proctree.shm_bytes()
    log_path = log_disk / "server.log"
    with open(log_path, "wb") as log:
        srv = start_server(
            tiny_model,
            "--set", f"heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
            codec_model=False, log=log,
        )  # fmt: skip
    n = Node(srv, log_path, shm_before)
    n.note_segments()
    yield n
    if srv.proc.poll() is None:
        stop_server(srv)
    _kill_all(instance_pids(srv.instance, n.sessions))  # only if a test failed midway


def test_codec_is_found_next_to_the_model(node: Node, tiny_model: Path) -> None:
    text = node.log_path.read_text(errors="replace")
    snac = tiny_model / "snac"
    assert f"codec: SNAC from {snac} (found next to --model" in text
    assert f"SNAC from {snac} on cpu" in text, "the codec worker says what it loaded"


def test_the_log_disk_fills_up(node: Node, log_disk: Path) -> None:
    """From here on every log line the server writes fails with ENOSPC."""
    filler = log_disk / "filler"
    try:
        with open(filler, "wb") as f:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
    except OSError:
        pass
    with pytest.raises(OSError):
        with open(log_disk / "probe", "wb") as f:
            f.write(b"x" * 8192)
            f.flush()
            os.fsync(f.fileno())
    assert _speak(node.srv.url) == 6 * 2048 * 2, "serving goes on with its log disk full"


def test_kill_9_llm_worker_cycles_leave_no_engine_and_no_growth(node: Node) -> None:
    orch = node.srv.proc.pid
    rows: list[tuple[int, int, int, int, float, float]] = []
    first_rss = first_shm = 0
    for cycle in range(CYCLES):
        llm = child_pid(orch, "llm")
        tree = {llm} | proctree.descendants([llm])
        engine = tree - {llm}
        assert engine, "vLLM runs its engine in child processes (EngineCore, Worker)"
        psm = {s for s in proctree.shm_mappings(tree) if not s.startswith(node.instance)}
        node.note_segments()
        pids = node.pids()
        rss, shm = rss_bytes(pids), segment_bytes(instance_segments(node.instance, pids))
        if cycle == 0:
            first_rss, first_shm = rss, shm
        os.kill(llm, signal.SIGKILL)
        t0 = time.monotonic()
        assert _wait_dead(tree, 30) == set(), f"cycle {cycle}: the engine outlived its worker"
        dead_s = time.monotonic() - t0
        assert _wait_gone(psm, 30) == set(), f"cycle {cycle}: vLLM's segments were left"
        _wait_restarted(orch, "llm", llm, 60)
        ready_s = wait_ready(node.srv.url, node.srv.proc.poll, 900, interval_s=0.25)
        assert _speak(node.srv.url) == 6 * 2048 * 2
        rows.append((cycle, rss, shm, len(psm), dead_s, ready_s))
    node.note_segments()
    pids = node.pids()
    end_rss = rss_bytes(pids)
    end_shm = segment_bytes(instance_segments(node.instance, pids))
    print("\ncycle  node RSS MB  instance /dev/shm MB  vLLM segments  engine dead s  ready s")
    for c, rss, shm, nseg, dead_s, ready_s in rows:
        print(f"{c:5d}  {rss / 1e6:11.0f}  {shm / 1e6:20.1f}  {nseg:13d}  {dead_s:13.2f}  "
              f"{ready_s:7.1f}")  # fmt: skip
    print(f"  end  {end_rss / 1e6:11.0f}  {end_shm / 1e6:20.1f}   (after {CYCLES} cycles)")
    assert end_shm <= first_shm + (1 << 20), "instance /dev/shm is where it started"
    assert end_rss <= first_rss * RSS_GROWTH_LIMIT, "node RSS is where it started"


def test_hung_codec_worker_is_killed_and_restarted(node: Node) -> None:
    orch = node.srv.proc.pid
    codec = child_pid(orch, "codec")
    os.kill(codec, signal.SIGSTOP)  # alive but silent
    t0 = time.monotonic()
    assert _wait_dead({codec}, HEARTBEAT_TIMEOUT_S + 60) == set(), "the hung worker was killed"
    killed_s = time.monotonic() - t0
    assert killed_s >= HEARTBEAT_TIMEOUT_S - 2, "killed by the heartbeat timeout"
    _wait_restarted(orch, "codec", codec, 60)
    ready_s = wait_ready(node.srv.url, node.srv.proc.poll, 300, interval_s=0.25)
    assert child_pid(orch, "codec") != codec
    assert _speak(node.srv.url) == 6 * 2048 * 2
    print(f"\nSIGSTOP codec: killed {killed_s:.1f}s later; ready again {ready_s:.1f}s after")


def test_kill_9_codec_worker_leaves_nothing(node: Node) -> None:
    orch = node.srv.proc.pid
    codec = child_pid(orch, "codec")
    tree = {codec} | proctree.descendants([codec])
    node.note_segments()
    os.kill(codec, signal.SIGKILL)
    assert _wait_dead(tree, 30) == set()
    _wait_restarted(orch, "codec", codec, 60)
    wait_ready(node.srv.url, node.srv.proc.poll, 300, interval_s=0.25)
    assert _speak(node.srv.url) == 6 * 2048 * 2


def test_sigterm_leaves_no_process_and_no_segment(node: Node) -> None:
    node.note_segments()
    assert len(node.pids()) >= 5, "orchestrator, 3 workers and vLLM's engine processes"
    assert stop_server(node.srv) == 0, "a clean stop exits 0, even with the log disk full"
    assert wait_no_instance_pids(node.instance, 30, node.sessions) == []
    left = _wait_gone(node.seen_segments, 10)
    assert left == set(), f"segments left: {left}"
    shm_after = proctree.shm_bytes()
    print(f"\n/dev/shm: {node.shm_before / 1e6:.1f} MB before the server, "
          f"{shm_after / 1e6:.1f} MB after it stopped (machine-wide; other jobs share it)")  # fmt: skip


def test_kill_9_orchestrator_takes_every_process_and_segment_down(
    tiny_model: Path, tmp_path: Path
) -> None:
    with open(tmp_path / "server.log", "wb") as log:
        srv = start_server(tiny_model, log=log)
    try:
        sessions = proctree.worker_sessions(srv.proc.pid)
        pids = instance_pids(srv.instance)
        segs = instance_segments(srv.instance, pids)
        assert len(pids) >= 5, "orchestrator, 3 workers and vLLM's engine processes"
        assert any(not s.startswith(srv.instance) for s in segs), "vLLM's psm_* segments"
        seg_bytes = segment_bytes(segs)
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait()
        t0 = time.monotonic()
        left = wait_no_instance_pids(srv.instance, 60, sessions)
        gone_s = time.monotonic() - t0
        assert left == [], f"processes left: {left}"
        assert _wait_gone(segs, 10) == set()
        print(f"\norchestrator kill -9: {len(pids)} processes and {len(segs)} segments "
              f"({seg_bytes / 1e6:.0f} MB) gone {gone_s:.1f}s later")  # fmt: skip
    finally:
        _kill_all(instance_pids(srv.instance, proctree.worker_sessions(srv.proc.pid) | sessions))
