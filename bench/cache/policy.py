"""Which admission and eviction policy the node cache keeps (``gateway/cache/node.py``),
measured on a voice-agent trace: plain LRU, admit-on-second-sight with LRU, and TinyLFU
(a count-min sketch with a doorkeeper, aged; a candidate replaces the LRU victim only if it
is seen more often).

The trace (``voice_agent_trace``): turns that open or close with one of 50 stock phrases
(Zipf popularity, s = 1) and carry two unique content sentences, so a third of the
sentences are stock phrases; in its middle a flood of one-off sentences (a bulk job, a
crawler) as long as a third of the trace. Sizes are the PCM bytes of the sentence's audio
(48 kB a second, 14 characters a second). The cache holds about 40 % of the stock
phrases' bytes, so which policy keeps the popular ones shows.

    python -m bench.cache.policy --out docs/results/cache_policy.json

Pure Python, no server, deterministic for a seed: it measures the policy's choice of what
to keep, not speed.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

BYTES_PER_CHAR = 48_000 / 14
STOCK = [f"stock phrase {i}: " + "thank you for calling, " * (1 + i % 4) for i in range(50)]


def voice_agent_trace(
    turns: int, *, seed: int = 1, zipf_s: float = 1.0, flood: int | None = None
) -> Iterator[tuple[str, int, bool]]:
    """(sentence, PCM bytes, in the flood) of ``turns`` turns, a flood of ``flood`` one-off
    sentences (default: as many as the turns' sentences / 3) after the first half."""
    rng = random.Random(seed)
    weights = [1 / (r + 1) ** zipf_s for r in range(len(STOCK))]
    flood = turns if flood is None else flood
    unique = 0

    def one_off() -> tuple[str, int]:
        nonlocal unique
        unique += 1
        n = rng.randint(40, 110)
        return f"content {unique}", int(n * BYTES_PER_CHAR)

    for t in range(turns):
        if t == turns // 2:
            for _ in range(flood):
                yield (*one_off(), True)
        phrase = rng.choices(STOCK, weights)[0]
        size = int(len(phrase) * BYTES_PER_CHAR)
        opens = rng.random() < 0.5
        if opens:
            yield phrase, size, False
        for _ in range(2):
            yield (*one_off(), False)
        if not opens:
            yield phrase, size, False


class Lru:
    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0

    def _evict_for(self, size: int) -> None:
        while self.bytes + size > self.capacity and self.items:
            _, s = self.items.popitem(last=False)
            self.bytes -= s

    def admit(self, key: str, size: int) -> bool:
        return True

    def access(self, key: str, size: int) -> bool:
        if key in self.items:
            self.items.move_to_end(key)
            return True
        if size <= self.capacity and self.admit(key, size):
            self._evict_for(size)
            self.items[key] = size
            self.bytes += size
        return False


class SecondSight(Lru):
    """LRU that stores a unit on its second synthesis within ``memory`` sightings (the node
    cache's rule: a bounded set of sighting files)."""

    name = "second_sight"

    def __init__(self, capacity: int, memory: int = 65_536) -> None:
        super().__init__(capacity)
        self.seen: OrderedDict[str, int] = OrderedDict()
        self.memory = memory

    def admit(self, key: str, size: int) -> bool:
        n = self.seen.pop(key, 0) + 1
        if n >= 2:
            return True
        self.seen[key] = n
        if len(self.seen) > self.memory:
            self.seen.popitem(last=False)
        return False


class TinyLfu(Lru):
    """W-less TinyLFU: a 4-row count-min sketch (halved every ``10 x`` its width accesses)
    behind a doorkeeper set; a candidate is stored if there is room or it is seen more often
    than the LRU victim."""

    name = "tinylfu"

    def __init__(self, capacity: int, width: int = 4096) -> None:
        super().__init__(capacity)
        self.width = width
        self.rows = [[0] * width for _ in range(4)]
        self.door: set[str] = set()
        self.events = 0

    def _slots(self, key: str) -> list[int]:
        h = hash(key)
        return [((h >> (16 * i)) ^ (h * (i + 1))) % self.width for i in range(4)]

    def _count(self, key: str) -> int:
        return min(r[s] for r, s in zip(self.rows, self._slots(key), strict=True)) + (
            key in self.door
        )

    def _record(self, key: str) -> None:
        self.events += 1
        if key not in self.door:
            self.door.add(key)
        else:
            for r, s in zip(self.rows, self._slots(key), strict=True):
                r[s] += 1
        if self.events >= 10 * self.width:
            self.events = 0
            self.door.clear()
            for r in self.rows:
                for i in range(self.width):
                    r[i] //= 2

    def access(self, key: str, size: int) -> bool:
        self._record(key)
        return super().access(key, size)

    def admit(self, key: str, size: int) -> bool:
        if self.bytes + size <= self.capacity or not self.items:
            return True
        victim = next(iter(self.items))
        return self._count(key) > self._count(victim)


def simulate(policy: Lru, trace: list[tuple[str, int, bool]]) -> dict[str, float]:
    hits = bytes_hit = total_bytes = repeats = 0
    after = after_hits = 0
    seen: set[str] = set()
    flood_over = False
    for key, size, in_flood in trace:
        hit = policy.access(key, size)
        hits += hit
        total_bytes += size
        bytes_hit += size if hit else 0
        repeats += key in seen
        seen.add(key)
        if in_flood:
            flood_over = True
        elif flood_over:
            after += 1
            after_hits += hit
    n = len(trace)
    return {
        "hit_ratio": round(hits / n, 4),
        "byte_hit_ratio": round(bytes_hit / total_bytes, 4),
        "repeated_ratio": round(repeats / n, 4),
        "hit_ratio_after_flood": round(after_hits / after, 4) if after else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20_000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    stock_bytes = sum(int(len(p) * BYTES_PER_CHAR) for p in STOCK)
    results: dict[str, object] = {"turns": args.turns, "stock_phrase_bytes": stock_bytes}
    for frac in (0.2, 0.4, 1.0, 4.0):
        capacity = int(stock_bytes * frac)
        row: dict[str, dict[str, float]] = {}
        for cls in (Lru, SecondSight, TinyLfu):
            runs = [
                simulate(cls(capacity), list(voice_agent_trace(args.turns, seed=s)))
                for s in range(1, args.seeds + 1)
            ]
            row[cls.name] = {k: round(sum(r[k] for r in runs) / len(runs), 4) for k in runs[0]}
        results[f"capacity_{frac:g}x_stock"] = {"capacity_bytes": capacity, **row}
        for name, r in row.items():
            print(f"capacity {frac:>4g} x stock  {name:>13}: {r}")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
