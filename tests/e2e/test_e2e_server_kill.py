"""The whole server killed, on the real server (vLLM on CPU with the tiny model, SNAC, rings,
the orchestrator): what it held is taken back (issue 47), and a long-form job survives it
with every unit spoken exactly once (issue 33). One scenario, a long-form job in flight
through all of it, with three engine start-ups, each needed:

1. **A whole-instance crash.** Every process of the instance is SIGKILLed at once with streams
   in flight and the job part-way (stopped first, so that none acts on another's death: the
   cgroup kill of the OOM killer or of ``systemctl kill -s KILL``). What it held in /dev/shm
   stays: its rings, vLLM's ``psm_*`` broadcast queues and a ``sem.mp-*`` semaphore.
2. **The next start reclaims** the first one's leftovers (one log line names them) and the
   job goes on where it stopped; then **kill -9 of the orchestrator alone**, mid-job, takes
   every process and segment of the instance down with it, vLLM's included.
3. **The third start** finishes the job: the file is the units kept from both killed servers,
   in their places, plus the rest, none lost and none twice. It is the live instance that
   ``orpheus-serve cleanup`` must leave alone, and is killed whole in turn (a crash loop's
   second whole kill), after which ``orpheus-serve cleanup`` (the operator's way, and what the
   systemd unit runs after a stop) takes back its leftovers without a fourth start.

/dev/shm is shared with whatever else runs on the machine: every assertion is about the files
the killed instances held (by name and inode), never about the directory as a whole.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import (
    EXE,
    NO_STORE,
    Server,
    describe_pids,
    instance_pids,
    present,
    start_server,
    wait_no_instance_pids,
    wait_segments_gone,
)

from bench.soak.sampling import instance_segments, segment_bytes
from gateway.jobs.store import JobStore
from llm_worker.engine.env import RPC_SOCKET_NAME
from orchestrator import proctree
from shm.records import SAMPLE_RATE
from shm.ring import SHM_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STREAMS = 3
UNITS = 24
"""Units of the job: enough that each kill lands with some done and some not."""
FRAMES = 6
"""Frames per unit at most (``max_tokens``; the random model may end a unit sooner)."""
BYTES_PER_SECOND = SAMPLE_RATE * 2


# -- what an instance holds ------------------------------------------------------------------
def held_files(srv: Server, pids: list[int]) -> dict[str, int]:
    """The /dev/shm files (name: inode) that the instance's processes map or hold, and its
    own ``orpheus-<pid>-*`` files."""
    inodes = proctree.shm_inodes(pids)
    return {
        e.name: e.inode()
        for e in os.scandir(SHM_DIR)
        if e.inode() in inodes or e.name.startswith(f"{srv.instance}-")
    }


# -- clients ---------------------------------------------------------------------------------
def _stream(url: str, started: threading.Event) -> None:
    body = json.dumps({"model": "tts-1", "input": "A stream the crash cuts short.",
                       "voice": "tara", "response_format": "pcm", "max_tokens": 7 * 400}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/audio/speech", body, {"Content-Type": "application/json", **NO_STORE}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            if r.read(2048):
                started.set()
            while r.read(65536):
                pass
    except (OSError, http.client.HTTPException):
        pass  # the server died under it


def _speak(url: str) -> int:
    body = json.dumps({"model": "tts-1", "input": "Still here.", "voice": "tara",
                       "response_format": "pcm", "max_tokens": 7 * 4, "seed": 3}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/audio/speech", body, {"Content-Type": "application/json", **NO_STORE}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return len(r.read())


def _call(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
        return raw if r.headers["Content-Type"].startswith("audio/") else json.loads(raw)


def _wait_job(url: str, done: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = _call(url)
        if done(job):
            return job  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"job stuck: {job}"
        time.sleep(0.2)


# -- the kills -------------------------------------------------------------------------------
def crash_mid_stream(srv: Server) -> dict[str, int]:
    """Start streams, and once each has audio SIGKILL every process of the instance at once.
    Returns what the instance held in /dev/shm just before."""
    events = [threading.Event() for _ in range(STREAMS)]
    threads = [threading.Thread(target=_stream, args=(srv.url, e), daemon=True) for e in events]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(300), "every stream has audio before the crash"
    sessions = proctree.worker_sessions(srv.proc.pid)
    pids = instance_pids(srv.instance, sessions)
    assert len(pids) >= 5, "orchestrator, 3 workers and vLLM's engine processes"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    pids = instance_pids(srv.instance, sessions)  # none can start another now
    held = held_files(srv, pids)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    srv.proc.wait(60)
    deadline = time.monotonic() + 60
    while instance_pids(srv.instance, sessions) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert instance_pids(srv.instance, sessions) == []
    for t in threads:
        t.join(60)
    return held


def kill_orchestrator(srv: Server) -> str:
    """kill -9 of the orchestrator alone: every process and segment of the instance goes with
    it, vLLM's included. Returns what was measured, for the log."""
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
    assert left == [], f"processes left {gone_s:.0f}s after: {describe_pids(left)}"
    assert wait_segments_gone(segs, 10) == set()
    return (
        f"orchestrator kill -9: {len(pids)} processes and {len(segs)} segments "
        f"({seg_bytes / 1e6:.0f} MB) gone {gone_s:.1f}s later"
    )


def _cleanup(run_dir: Path) -> str:
    out = subprocess.run(
        [EXE, "cleanup", "--set", f"shm.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _kill_left(srv: Server, sessions: set[int] | None = None) -> None:
    """After a failed test: no process of the instance outlives it."""
    if srv.proc.poll() is None:
        sessions = (sessions or set()) | proctree.worker_sessions(srv.proc.pid)
        srv.proc.kill()
        srv.proc.wait()
    left = instance_pids(srv.instance, sessions)
    if left:
        proctree.kill_tree(-1, extra=left)


@pytest.fixture
def run_dir() -> Iterator[Path]:
    """``shm.run_dir`` under a short path: vLLM's ipc sockets go in the instance's socket
    directory (``<run_dir>/orpheus-<pid>/<uuid4>``), and a socket's path is at most 107 bytes
    (a test's ``tmp_path`` is longer)."""
    path = Path(tempfile.mkdtemp(prefix="orpheus-run-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_whole_server_kill_is_reclaimed_and_a_job_survives_it(
    tiny_model: Path, tmp_path: Path, run_dir: Path
) -> None:
    jobs_dir = tmp_path / "jobs"
    args = ["--set", f"shm.run_dir={run_dir}", "--set", f"jobs.dir={jobs_dir}",
            "--set", "jobs.streams_per_job=1"]  # fmt: skip
    text = " ".join(f"Sentence number {i} of the chapter." for i in range(UNITS))
    store = JobStore(jobs_dir)

    # 1. A job part-way and streams in flight, then every process SIGKILLed at once.
    with open(tmp_path / "first.log", "wb") as log:
        first = start_server(tiny_model, *args, codec_model=False, log=log, worker_process=True)
    try:
        job = _call(f"{first.url}/v1/audio/jobs", {"input": text, "voice": "tara",
                    "response_format": "pcm", "max_tokens": 7 * FRAMES, "seed": 1})  # fmt: skip
        _wait_job(f"{first.url}{job['url']}", lambda j: j["progress"]["units_done"] >= 2, 600)
        held1 = crash_mid_stream(first)
    finally:
        _kill_left(first)
    left1 = present(held1)
    vllm1 = {n for n in left1 if not n.startswith(first.instance)}
    assert any(n.startswith("psm_") for n in vllm1), f"the premise: vLLM's queues left {left1}"
    assert any(n.startswith(f"{first.instance}-codes") for n in left1), "and the rings"
    left_bytes = sum(os.stat(os.path.join(SHM_DIR, n)).st_blocks * 512 for n in left1)
    assert (run_dir / first.instance).is_dir(), "and its socket directory"
    vllm_sockets = [
        p for p in (run_dir / first.instance).iterdir() if RPC_SOCKET_NAME.match(p.name)
    ]
    assert vllm_sockets and all(p.is_socket() for p in vllm_sockets), "with vLLM's in it"
    done1 = store.done_units(job["id"])
    assert store.state(job["id"]).state == "running" and 2 <= len(done1) < UNITS
    kept1 = {i: store.read_unit(job["id"], i) for i in done1}

    # 2. The next start reclaims them; the job goes on; kill -9 of the orchestrator mid-job.
    second_log = tmp_path / "second.log"
    with open(second_log, "wb") as log:
        second = start_server(tiny_model, *args, codec_model=False, log=log, worker_process=True)
    sessions = proctree.worker_sessions(second.proc.pid)
    try:
        assert present(held1) == set(), f"the start left {present(held1)} of the dead instance"
        assert not (run_dir / first.instance).exists()
        lines = [ln for ln in second_log.read_text(errors="replace").splitlines()
                 if "reclaim: dead instance(s)" in ln and first.instance in ln]  # fmt: skip
        assert len(lines) == 1, "one line says what was freed"
        assert all(n in lines[0] for n in vllm1), lines[0]
        _wait_job(
            f"{second.url}{job['url']}",
            lambda j: j["progress"]["units_done"] > len(done1),
            600,
        )
        killed = kill_orchestrator(second)
    finally:
        _kill_left(second, sessions)
    done2 = store.done_units(job["id"])
    assert store.state(job["id"]).state == "running" and len(done1) < len(done2) < UNITS
    kept = {i: store.read_unit(job["id"], i) for i in done2}

    # 3. The third start finishes the job; cleanup spares it live and reclaims it killed.
    with open(tmp_path / "third.log", "wb") as log:
        third = start_server(tiny_model, *args, codec_model=False, log=log, worker_process=True)
    try:
        url = f"{third.url}{job['url']}"
        done = _wait_job(url, lambda j: j["state"] in ("done", "failed", "cancelled"), 900)
        assert done["state"] == "done", done
        pcm = _call(f"{url}/audio")
        spoken = third.metric("orpheus_gateway_requests_total", api="jobs", outcome="ok")
        new_bytes = third.metric("orpheus_gateway_job_audio_seconds_total") * BYTES_PER_SECOND

        pids3 = instance_pids(third.instance, proctree.worker_sessions(third.proc.pid))
        live = held_files(third, pids3)
        assert any(n.startswith("psm_") for n in live)
        said = _cleanup(run_dir)
        assert third.instance not in said, said
        assert present(live) == set(live), "a live instance's files are untouched"
        assert _speak(third.url) > 0, "and it still serves"

        held3 = crash_mid_stream(third)
    finally:
        _kill_left(third)
    assert any(n.startswith("psm_") for n in present(held3)), "the last crash left its own"
    said = _cleanup(run_dir)
    assert f"dead instance(s) {third.instance}" in said, said
    assert present(held3) == set(), f"cleanup left {present(held3)}"
    assert not (run_dir / third.instance).exists()

    # The job: the units finished before the kills are not spoken again, none is lost, and
    # the file is the units kept plus the units spoken after, the kept ones in their places.
    assert all(kept[i] == kept1[i] for i in done1), "the second server kept the first's units"
    assert spoken == UNITS - len(done2)
    assert abs(len(pcm) - (sum(done2.values()) + new_bytes)) < UNITS
    at = 0
    for i in range(UNITS):
        if i not in kept:
            break
        assert pcm[at : at + len(kept[i])] == kept[i]
        at += len(kept[i])
    assert at > 0
    print(
        f"\nwhole-server kill -9: {len(left1)} files ({left_bytes / 1e6:.0f} MB) left, "
        f"reclaimed by the next start: {lines[0]}\n{killed}\n"
        f"job units done at each kill: {len(done1)}, {len(done2)} of {UNITS}"
    )
