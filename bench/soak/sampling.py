"""One sample of a running instance: every process's RSS and open file descriptors, its
/dev/shm segments, and the TTFB of the streams started since the last sample."""

from __future__ import annotations

import os

from bench.lib.stats import percentile
from bench.soak.results import ProcSample, Sample
from orchestrator import proctree
from shm.ring import SHM_DIR


def _name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return "?"
    if not argv:
        return "?"
    text = " ".join(argv)
    if text.startswith("orpheus-serve "):
        return " ".join(text.split()[:2])
    if "resource_tracker" in text:
        return "resource_tracker"
    if "orpheus-serve" in text and " serve" in text:
        return "orchestrator"
    return os.path.basename(argv[0])[:40]


def _status_rss(pid: int) -> tuple[int, int]:
    """(RSS, its shared-memory part) in bytes; zeros for a process that is gone."""
    rss = shmem = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("RssShmem:"):
                    shmem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss, shmem


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def instance_segments(instance: str, pids: list[int]) -> set[str]:
    """The /dev/shm segments of an instance: its own, and those its processes map."""
    own = {n for n in os.listdir(SHM_DIR) if n.startswith(f"{instance}-")}
    return own | proctree.shm_mappings(pids)


def segment_bytes(names: set[str]) -> int:
    """The bytes the /dev/shm segments take (those still there)."""
    total = 0
    for n in names:
        try:
            total += os.stat(os.path.join(SHM_DIR, n)).st_blocks * 512
        except OSError:
            pass
    return total


def segment_sizes(names: set[str]) -> int:
    """The apparent sizes of the /dev/shm segments (those still there)."""
    total = 0
    for n in names:
        try:
            total += os.stat(os.path.join(SHM_DIR, n)).st_size
        except OSError:
            pass
    return total


def sample_instance(instance: str, t_s: float, ttfbs: list[float]) -> Sample:
    pids = proctree.instance_processes(int(instance.rsplit("-", 1)[1]))
    procs = []
    for p in pids:
        rss, shmem = _status_rss(p)
        procs.append(ProcSample(_name(p), p, rss, _fds(p), shmem))
    segments = instance_segments(instance, pids)
    shm, size = segment_bytes(segments), segment_sizes(segments)
    return Sample(
        t_s=round(t_s, 1),
        processes=procs,
        rss_bytes=sum(p.rss_bytes for p in procs),
        fds=sum(p.fds for p in procs),
        shm_bytes=shm,
        shm_total_bytes=proctree.shm_bytes(),
        shm_segments=len(segments),
        shm_size_bytes=size,
        streams=len(ttfbs),
        ttfb_p99_s=_pct(ttfbs, 99),
        ttfb_p50_s=_pct(ttfbs, 50),
    )


def _pct(values: list[float], q: float) -> float | None:
    return round(percentile(values, q), 4) if values else None
