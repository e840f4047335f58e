"""A crash of the whole server leaves nothing behind (issue 47), on the real server: vLLM on
CPU with the tiny model.

Every process of the instance is SIGKILLed at once with streams in flight (stopped first, so
that none acts on another's death: the cgroup kill of the OOM killer or of
``systemctl kill -s KILL``). What it held in /dev/shm stays: its rings, vLLM's
``psm_*`` broadcast queues and a ``sem.mp-*`` semaphore. The next start must take them back.

Two engine start-ups, each needed:

1. the server that is killed: a crash needs a running engine holding its segments;
2. the start after the crash, with the same ``shm.run_dir``: it must reclaim the first one's
   leftovers (the point of the issue). It then serves as the live instance that
   ``orpheus-serve cleanup`` must leave alone, and is killed whole in turn (the second kill of a
   crash loop), after which ``orpheus-serve cleanup`` (the operator's way, and what the
   systemd unit runs after a stop) takes back its leftovers without a third start.

/dev/shm is shared with whatever else runs on the machine: every assertion is about the files
the killed instances held (by name and inode), never about the directory as a whole.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from e2e_harness import EXE, Server, instance_pids, start_server

from orchestrator import proctree
from shm.ring import SHM_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

STREAMS = 3


def held_files(srv: Server, pids: list[int]) -> dict[str, int]:
    """The /dev/shm files (name: inode) that the instance's processes map or hold, and its
    own ``orpheus-<pid>-*`` files."""
    inodes = proctree.shm_inodes(pids)
    return {
        e.name: e.inode()
        for e in os.scandir(SHM_DIR)
        if e.inode() in inodes or e.name.startswith(f"{srv.instance}-")
    }


def present(files: dict[str, int]) -> set[str]:
    out = set()
    for name, inode in files.items():
        try:
            if os.stat(os.path.join(SHM_DIR, name)).st_ino == inode:
                out.add(name)
        except FileNotFoundError:
            pass
    return out


def _stream(url: str, started: threading.Event) -> None:
    body = json.dumps({"model": "tts-1", "input": "A stream the crash cuts short.",
                       "voice": "tara", "response_format": "pcm", "max_tokens": 7 * 400}).encode()  # fmt: skip
    req = urllib.request.Request(
        f"{url}/v1/audio/speech", body, {"Content-Type": "application/json"}
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
        f"{url}/v1/audio/speech", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        return len(r.read())


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


def _cleanup(run_dir: Path) -> str:
    out = subprocess.run(
        [EXE, "cleanup", "--set", f"shm.run_dir={run_dir}"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return out.stdout.strip()


def _kill_left(srv: Server) -> None:
    """After a failed test: no process of the instance outlives it."""
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait()
    left = instance_pids(srv.instance)
    if left:
        proctree.kill_tree(-1, extra=left)


def test_a_start_after_a_whole_server_kill_reclaims_what_the_dead_one_held(
    tiny_model: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    state = ["--set", f"shm.run_dir={run_dir}"]
    with open(tmp_path / "first.log", "wb") as log:
        first = start_server(tiny_model, *state, codec_model=False, log=log)
    try:
        held1 = crash_mid_stream(first)
    finally:
        _kill_left(first)
    left1 = present(held1)
    vllm1 = {n for n in left1 if not n.startswith(first.instance)}
    assert any(n.startswith("psm_") for n in vllm1), f"the premise: vLLM's queues left {left1}"
    assert any(n.startswith(f"{first.instance}-codes") for n in left1), "and the rings"
    left_bytes = sum(os.stat(os.path.join(SHM_DIR, n)).st_blocks * 512 for n in left1)
    assert (run_dir / first.instance).is_dir(), "and its socket directory"

    second_log = tmp_path / "second.log"
    with open(second_log, "wb") as log:
        second = start_server(tiny_model, *state, codec_model=False, log=log)
    try:
        assert present(held1) == set(), f"the start left {present(held1)} of the dead instance"
        assert not (run_dir / first.instance).exists()
        lines = [ln for ln in second_log.read_text(errors="replace").splitlines()
                 if "reclaim: dead instance(s)" in ln and first.instance in ln]  # fmt: skip
        assert len(lines) == 1, "one line says what was freed"
        assert all(n in lines[0] for n in vllm1), lines[0]

        # The live instance beside: an operator's cleanup takes nothing of it.
        pids2 = instance_pids(second.instance, proctree.worker_sessions(second.proc.pid))
        live = held_files(second, pids2)
        assert any(n.startswith("psm_") for n in live)
        said = _cleanup(run_dir)
        assert second.instance not in said, said
        assert present(live) == set(live), "a live instance's files are untouched"
        assert _speak(second.url) > 0, "and it still serves"

        held2 = crash_mid_stream(second)
    finally:
        _kill_left(second)
    assert any(n.startswith("psm_") for n in present(held2)), "the second crash left its own"
    said = _cleanup(run_dir)
    assert f"dead instance(s) {second.instance}" in said, said
    assert present(held2) == set(), f"cleanup left {present(held2)}"
    assert not (run_dir / second.instance).exists()
    print(f"\nwhole-server kill -9: {len(left1)} files ({left_bytes / 1e6:.0f} MB) left, "
          f"reclaimed by the next start: {lines[0]}")  # fmt: skip
