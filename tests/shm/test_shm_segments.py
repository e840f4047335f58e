"""Segment lifecycle: created per instance, unlinked on exit, stale ones removed at start.

Removing stale instances takes every dead instance's files, other tests' too: these tests run
one at a time with the reclaim tests across pytest-xdist workers (``shm_reclaim_lock``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.ring import segment_path
from shm.segments import create_instance, destroy_instance, remove_stale_instances

pytestmark = pytest.mark.usefixtures("shm_reclaim_lock")

SMALL = ShmConfig(code_ring_bytes=64 << 10, pcm_ring_bytes=256 << 10)


def test_create_and_destroy_leave_nothing() -> None:
    run_dir = tempfile.mkdtemp()
    lay = InstanceLayout.for_pid(os.getpid(), run_dir, gateways=2)
    create_instance(lay, SMALL)
    assert all(os.path.exists(segment_path(ep.segment)) for ep in lay.all_rings())
    assert len(lay.all_rings()) == 3
    destroy_instance(lay)
    assert not any(os.path.exists(segment_path(ep.segment)) for ep in lay.all_rings())
    assert not os.path.exists(lay.socket_dir)


def test_killed_instance_is_removed_as_stale() -> None:
    run_dir = tempfile.mkdtemp()
    script = textwrap.dedent(f"""
        import os, sys, time
        from shm.config import ShmConfig
        from shm.layout import InstanceLayout
        from shm.segments import create_instance
        lay = InstanceLayout.for_pid(os.getpid(), {run_dir!r}, gateways=1)
        create_instance(lay, ShmConfig(code_ring_bytes=65536, pcm_ring_bytes=262144))
        print(lay.instance, flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    instance = proc.stdout.readline().strip()
    lay = InstanceLayout(instance=instance, run_dir=run_dir, gateways=1)
    assert os.path.exists(segment_path(lay.engine_code_ring(0).segment))
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The dead process left its segments behind; the next start removes them.
    assert os.path.exists(segment_path(lay.engine_code_ring(0).segment))
    removed = remove_stale_instances(run_dir)
    assert segment_path(lay.engine_code_ring(0).segment) in removed
    assert not any(os.path.exists(segment_path(ep.segment)) for ep in lay.all_rings())
    assert not os.path.exists(lay.socket_dir)


def test_live_instances_are_kept() -> None:
    run_dir = tempfile.mkdtemp()
    lay = InstanceLayout.for_pid(os.getpid(), run_dir, gateways=1)
    create_instance(lay, SMALL)
    try:
        remove_stale_instances(run_dir)
        assert os.path.exists(segment_path(lay.engine_code_ring(0).segment))
    finally:
        destroy_instance(lay)


def test_destroy_removes_every_segment_of_the_instance() -> None:
    """A worker's own segment under the instance prefix (e.g. the llm_worker's counter board,
    left behind when it was killed with -9) goes with the instance."""
    run_dir = tempfile.mkdtemp()
    lay = InstanceLayout.for_pid(os.getpid(), run_dir, gateways=1)
    create_instance(lay, SMALL)
    extra = segment_path(f"{lay.instance}-prevented")
    with open(extra, "wb") as f:
        f.write(b"\0" * 64)
    destroy_instance(lay)
    assert not os.path.exists(extra)
