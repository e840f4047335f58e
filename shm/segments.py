"""Lifecycle of an instance's shared-memory segments and socket directory.

The orchestrator owns them: it creates them before starting workers, unlinks them on exit,
and at start removes those of instances whose orchestrator is dead (``orpheus-<pid>-*``;
``orchestrator.reclaim`` also takes back what such an instance's workers held).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable

from shm.admission import create_admission_segment, unlink_admission_segment
from shm.config import ShmConfig
from shm.layout import SEGMENT_PREFIX, InstanceLayout, pid_alive
from shm.ring import SHM_DIR, create_ring, unlink_ring

_INSTANCE_RE = re.compile(rf"^{re.escape(SEGMENT_PREFIX)}(\d+)(?:-|$)")


def create_instance(layout: InstanceLayout, cfg: ShmConfig) -> None:
    os.makedirs(layout.socket_dir, mode=0o700, exist_ok=True)
    for e in range(layout.engines):
        create_ring(layout.engine_code_ring(e), cfg.code_ring_bytes)
    for i in range(layout.gateways):
        create_ring(layout.pcm_ring(i), cfg.pcm_ring_bytes)
    if layout.shared_admission:
        create_admission_segment(layout.admission_segment, layout.gateways)


def destroy_instance(layout: InstanceLayout) -> None:
    """Unlink every segment of the instance (the rings, and any other segment a worker made
    under the instance prefix) and remove the socket directory. Idempotent."""
    for ep in layout.all_rings():
        unlink_ring(ep)
    unlink_admission_segment(layout.admission_segment)
    for name in instance_segments(layout.instance):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    shutil.rmtree(layout.socket_dir, ignore_errors=True)


def describe_segments(layout: InstanceLayout) -> str:
    """One line for the start-up log: the instance's segments and their sizes."""
    parts = []
    for name in instance_segments(layout.instance):
        try:
            size = os.stat(os.path.join(SHM_DIR, name)).st_size
        except OSError:
            continue
        parts.append(f"{name[len(layout.instance) + 1 :]} {size / (1 << 20):.1f} MiB")
    return (
        f"shared memory: {len(parts)} segments created in {SHM_DIR} for instance "
        f"{layout.instance} ({', '.join(parts)}); sockets in {layout.socket_dir}"
    )


def instance_segments(instance: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{instance}-"))


def remove_stale_instances(run_dir: str, dead: Callable[[str], bool] | None = None) -> list[str]:
    """Remove the segments (``orpheus-<pid>-*``) and socket dirs of dead instances; returns
    their paths. ``dead(instance)`` says which are; by default those whose orchestrator pid
    runs no process (``orchestrator.reclaim`` passes a finer rule, and logs what went)."""
    is_dead = dead or (lambda instance: not pid_alive(int(instance[len(SEGMENT_PREFIX) :])))
    removed: list[str] = []
    for directory, is_shm in ((SHM_DIR, True), (run_dir, False)):
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            continue
        for name in names:
            m = _INSTANCE_RE.match(name)
            if not m or not is_dead(f"{SEGMENT_PREFIX}{m.group(1)}"):
                continue
            path = os.path.join(directory, name)
            if is_shm:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed
