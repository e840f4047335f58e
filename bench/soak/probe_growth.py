"""What the memory probe saw inside each process of a soak (``bench soak --profile-memory``).

The soak's own samples see a process from outside (its RSS); the probe
(:mod:`common.memory_probe`) sees it from inside, and so tells growth of live memory from
memory freed but kept: for every process, ``summarize`` compares the first window after the
warm-up with the last one, taking each window's *lowest* value of every quantity (the level
between floods: a flood raises everything for a moment and says nothing about what stays):

- ``uss``: private pages (``Private_Clean + Private_Dirty``);
- ``anonymous``: anonymous pages, of which ``heap`` is glibc's main arena (``[heap]``);
- ``malloc_in_use`` (``uordblks + hblkhd``) and ``malloc_free`` (``fordblks``): glibc's view;
  in use growing is live C memory, free growing with in use flat is fragmentation;
- ``other_anonymous``: anonymous pages outside glibc's heap and its mmapped blocks (CPython's
  object arenas, thread stacks, other mmaps);
- ``objects``: objects the cyclic collector tracks (those frozen at start-up excluded), and the
  types whose count grew most.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import msgspec

MB = 1e6
QUANTITIES = ("uss", "anonymous", "heap", "malloc_in_use", "malloc_free", "other_anonymous")


class Level(msgspec.Struct, frozen=True):
    base: float
    end: float

    @property
    def growth(self) -> float:
        return self.end - self.base


class ProbeGrowth(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    pid: int
    samples: int
    window_s: float
    """Length of the first and the last window after the warm-up."""
    mb: dict[str, Level]
    """Quantity (``QUANTITIES``) -> its lowest value in the first and the last window, MB."""
    objects: Level
    grown_types: dict[str, int]
    """Types whose tracked-object count grew most between the two windows' last samples."""
    gc_collections: list[int]
    """Collections of each generation over the run (the last sample's)."""
    sweeps: int = 0
    """Full collections on the clock (``common.heap.settle``) over the run."""
    sweep_max_ms: float = 0.0
    """The longest of their pauses."""


def read_samples(path: Path) -> list[dict[str, Any]]:
    """A probe file's samples (lines the probe wrote as errors are skipped)."""
    out = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by the process's end
        if "rollup" in rec:
            out.append(rec)
    return out


def quantities(rec: dict[str, Any]) -> dict[str, float]:
    r = rec["rollup"]
    m = rec.get("malloc", {})
    mmapped = m.get("hblkhd", 0)
    return {
        "uss": (r.get("Private_Clean", 0) + r.get("Private_Dirty", 0)) / MB,
        "anonymous": r.get("Anonymous", 0) / MB,
        "heap": rec.get("heap_rss", 0) / MB,
        "malloc_in_use": (m.get("uordblks", 0) + mmapped) / MB,
        "malloc_free": m.get("fordblks", 0) / MB,
        "other_anonymous": (r.get("Anonymous", 0) - rec.get("heap_rss", 0) - mmapped) / MB,
    }


def _lowest(window: list[dict[str, Any]]) -> dict[str, float]:
    values = [quantities(rec) for rec in window]
    return {q: min(v[q] for v in values) for q in QUANTITIES}


def summarize_process(
    samples: list[dict[str, Any]], after_t: float, window_s: float | None = None, top: int = 8
) -> ProbeGrowth | None:
    """Growth of one process's samples after the epoch time ``after_t`` (None: too few)."""
    late = [s for s in samples if s["t"] >= after_t]
    if len(late) < 4:
        return None
    span = late[-1]["t"] - late[0]["t"]
    w = window_s if window_s is not None else max(span / 4, 1e-9)
    first = [s for s in late if s["t"] <= late[0]["t"] + w]
    last = [s for s in late if s["t"] >= late[-1]["t"] - w]
    lo_first, lo_last = _lowest(first), _lowest(last)
    a, b = first[-1].get("objects", {}), last[-1].get("objects", {})
    grown = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
    sweeps = late[-1].get("gc", {}).get("sweeps", {})
    grown_types = dict(
        sorted(((k, v) for k, v in grown.items() if v > 0), key=lambda kv: -kv[1])[:top]
    )
    return ProbeGrowth(
        name=late[-1].get("name", "?"),
        pid=0,
        samples=len(late),
        window_s=round(w, 1),
        mb={q: Level(round(lo_first[q], 2), round(lo_last[q], 2)) for q in QUANTITIES},
        objects=Level(
            float(min(s.get("objects_total", 0) for s in first)),
            float(min(s.get("objects_total", 0) for s in last)),
        ),
        grown_types=grown_types,
        gc_collections=list(late[-1].get("gc", {}).get("collections", [])),
        sweeps=int(sweeps.get("count", 0)),
        sweep_max_ms=round(float(sweeps.get("max_s", 0.0)) * 1000, 2),
    )


def summarize(directory: Path, after_t: float, window_s: float | None = None) -> list[ProbeGrowth]:
    """One ``ProbeGrowth`` per probe file in ``directory`` with enough samples after ``after_t``
    (epoch seconds), ordered by name."""
    out = []
    for path in sorted(directory.glob("*.jsonl")):
        g = summarize_process(read_samples(path), after_t, window_s)
        if g is not None:
            out.append(msgspec.structs.replace(g, pid=int(path.stem)))
    return sorted(out, key=lambda g: (g.name, g.pid))


def print_probe(growth: Iterable[ProbeGrowth]) -> None:
    rows = list(growth)
    if not rows:
        print("\nmemory probe: no process has samples enough after the warm-up")
        return
    print(f"\ninside each process (memory probe): lowest level in the first -> the last "
          f"{rows[0].window_s:.0f} s after the warm-up, MB (objects: tracked by the collector)")  # fmt: skip
    heads = ("USS", "anon", "[heap]", "malloc used", "malloc free", "other anon")
    print(f"{'process':26s}" + "".join(f"{h:>19s}" for h in heads) + f"{'objects':>20s}")
    for g in rows:
        cells = "".join(
            f"{g.mb[q].base:.1f}->{g.mb[q].end:.1f} {g.mb[q].growth:+.1f}".rjust(19)
            for q in QUANTITIES
        )
        objects = f"{g.objects.base:.0f}->{g.objects.end:.0f}".rjust(20)
        print(f"{g.name[:26]:26s}{cells}{objects}")
        grown = ", ".join(f"{k} +{v}" for k, v in g.grown_types.items()) or "none"
        print(f"{'':26s}  objects that grew: {grown}; full collections on the clock: "
              f"{g.sweeps}, longest {g.sweep_max_ms:.1f} ms")  # fmt: skip
