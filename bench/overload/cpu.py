"""The server's CPU by part over a phase of ``bench overload``: what the gateway's refusals
cost beside the engine and the codec on a shared CPU (docs/performance.md, issue 60).

``process_tree_cpu_s`` reads ``/proc`` (Linux; elsewhere nothing): the CPU seconds so far of a
process and its descendants, grouped by the part their title names (``orpheus-serve gateway-0``
is ``gateway``, ``orpheus-serve codec`` ``codec``, ``orpheus-serve llm`` and its vLLM
processes ``llm``, the rest ``other``), and of the benchmark's own process (``bench``).
``cores`` turns two readings into cores used per part over the wall time between them.
"""

from __future__ import annotations

import os
import resource

PARTS = ("gateway", "codec", "llm")


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _part(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            title = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    for part in PARTS:
        if title.startswith(f"orpheus-serve {part}"):
            return part
    return "other"


def process_tree_cpu_s(root: int | None) -> dict[str, float]:
    """CPU seconds so far of ``root`` and its descendants by part, and ``bench``'s own."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    out = {"bench": usage.ru_utime + usage.ru_stime}
    if root is None or not os.path.isdir("/proc"):
        return out
    stats: dict[int, tuple[int, float]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    todo = [(root, "other")]
    while todo:
        pid, inherited = todo.pop()
        if pid not in stats:
            continue
        part = _part(pid)
        part = inherited if part == "other" else part  # vLLM's processes are the llm's
        out[part] = out.get(part, 0.0) + stats[pid][1]
        todo += [(c, part) for c in children.get(pid, [])]
    return out


def cores(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """Cores used per part between two readings ``wall_s`` apart (a part gone since counts
    what it had used by the first reading as spent before it)."""
    if wall_s <= 0:
        return {}
    return {
        part: round(max(0.0, after[part] - before.get(part, 0.0)) / wall_s, 3)
        for part in sorted(after)
    }
