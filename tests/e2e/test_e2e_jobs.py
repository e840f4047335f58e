"""A long-form job on the real server (vLLM on CPU with the tiny model, SNAC, rings, the
orchestrator): kill -9 of the orchestrator in the middle of the job takes every process and
segment of the instance down with it (vLLM's included), and a new server on the same jobs
directory finishes the job, every unit spoken exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import (
    instance_pids,
    start_server,
    stop_server,
    wait_no_instance_pids,
    wait_segments_gone,
)

from bench.load.soak import instance_segments, segment_bytes
from gateway.jobs.store import JobStore
from orchestrator import proctree
from shm.records import SAMPLE_RATE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

UNITS = 8
FRAMES = 6
"""Frames per unit at most (``max_tokens``; the random model may end a unit sooner)."""
BYTES_PER_SECOND = SAMPLE_RATE * 2


def _call(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        raw = r.read()
        return raw if r.headers["Content-Type"].startswith("audio/") else json.loads(raw)


def _wait(url: str, done: Any, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        job = _call(url)
        if done(job):
            return job  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"job stuck: {job}"
        time.sleep(0.2)


def test_a_job_survives_kill_9_of_the_whole_server(tiny_model: Path, tmp_path: Path) -> None:
    jobs_dir = tmp_path / "jobs"
    args = ("--set", f"jobs.dir={jobs_dir}", "--set", "jobs.streams_per_job=1")
    text = " ".join(f"Sentence number {i} of the chapter." for i in range(UNITS))
    with open(tmp_path / "server1.log", "wb") as log:
        srv = start_server(tiny_model, *args, log=log)
    try:
        sessions = proctree.worker_sessions(srv.proc.pid)
        job = _call(f"{srv.url}/v1/audio/jobs", {"input": text, "voice": "tara",
                    "response_format": "pcm", "max_tokens": 7 * FRAMES, "seed": 1})  # fmt: skip
        url = f"{srv.url}{job['url']}"
        _wait(url, lambda j: j["progress"]["units_done"] >= 2, 600)
        pids = instance_pids(srv.instance)
        segs = instance_segments(srv.instance, pids)
        assert len(pids) >= 5, "orchestrator, 3 workers and vLLM's engine processes"
        assert any(not s.startswith(srv.instance) for s in segs), "vLLM's psm_* segments"
        seg_bytes = segment_bytes(segs)
        os.kill(srv.proc.pid, signal.SIGKILL)  # the orchestrator: the whole server goes down
        srv.proc.wait()
        t0 = time.monotonic()
        left = wait_no_instance_pids(srv.instance, 60, sessions)
        gone_s = time.monotonic() - t0
        assert left == [], f"processes left: {left}"
        assert wait_segments_gone(segs, 10) == set()
        print(f"\norchestrator kill -9: {len(pids)} processes and {len(segs)} segments "
              f"({seg_bytes / 1e6:.0f} MB) gone {gone_s:.1f}s later")  # fmt: skip
    finally:
        left = instance_pids(srv.instance, proctree.worker_sessions(srv.proc.pid) | sessions)
        if left:  # only if the test failed midway
            proctree.kill_tree(-1, extra=left)
    store = JobStore(jobs_dir)
    before = store.done_units(job["id"])
    assert store.state(job["id"]).state == "running" and 2 <= len(before) < UNITS
    kept = {i: store.read_unit(job["id"], i) for i in before}

    with open(tmp_path / "server2.log", "wb") as log:
        srv = start_server(tiny_model, *args, log=log)
    try:
        url = f"{srv.url}{job['url']}"
        done = _wait(url, lambda j: j["state"] in ("done", "failed", "cancelled"), 900)
        assert done["state"] == "done", done
        pcm = _call(f"{url}/audio")
        spoken = srv.metric("orpheus_gateway_requests_total", api="jobs", outcome="ok")
        new_bytes = srv.metric("orpheus_gateway_job_audio_seconds_total") * BYTES_PER_SECOND
    finally:
        assert stop_server(srv) == 0
    assert spoken == UNITS - len(before)  # the units finished before the kill: not again
    # None lost, none repeated: the file is the units kept plus the units spoken after.
    assert abs(len(pcm) - (sum(before.values()) + new_bytes)) < UNITS
    at = 0
    for i in range(UNITS):  # the units made before the kill, in their places
        if i not in kept:
            break
        assert pcm[at : at + len(kept[i])] == kept[i]
        at += len(kept[i])
    assert at > 0
