"""The component benchmarks of two checkouts, side by side in one run (docs/performance.md).

    python scripts/dev/ab_components.py --before ../before --after . --json out.json

Each round runs every benchmark once in each tree, alternating which goes first, so that a
drift of the machine (other load, thermal state) falls on both. The ``server`` benchmark
starts each tree's own server (tiny model, CPU, loopback) and drives it with ``bench load``.
A tree's command is found by what it has: ``python -m orpheus_serve`` where that package exists, else the older
``python -m orchestrator.cli``. Prints a table of medians and after/before ratios and writes
them, with every run's raw value, as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Extract = Callable[[dict[str, Any]], float]


@dataclass(frozen=True)
class Bench:
    name: str
    args: tuple[str, ...]
    metric: str
    """What the number is, with its unit; ``lower`` says which way is better."""
    lower: bool
    extract: Extract
    server: bool = False
    """Run against a server of the same tree (the tiny model on CPU), started for the run."""


def _level(key: str, field: str, value: int) -> Extract:
    return lambda d: next(r[field] for r in d[key] if r["streams"] == value)


BENCHES = (
    Bench(
        "server",
        tuple("load --concurrency 8 --duration 20 --fixed-tokens 140 --no-progress".split()),
        "whole server, tiny model on CPU: audio s per s at 8 streams",
        False,
        lambda d: d["levels"][0]["audio_s_per_s"],
        server=True,
    ),
    Bench(
        "codec",
        tuple(
            "codec --streams 8 --frames 24 --rounds 1 --seam-frames 8 --seam-streams 1 --threads 1".split()
        ),
        "codec worker CPU s per audio s, 8 streams",
        True,
        _level("levels", "worker_cpu_s_per_audio_s", 8),
    ),
    Bench(
        "codes",
        ("codes", "--streams", "64", "--steps", "200", "--rounds", "3"),
        "llm worker frame mapping, us per step at 64 streams",
        True,
        lambda d: next(r for r in d["results"] if r["streams"] == 64)[
            "us_per_step_vectorised_guard"
        ],
    ),
    Bench(
        "ring",
        ("ring", "--records", "1000"),
        "ReaderGroup of 1 ring: has_data ns (the codec loop's check)",
        True,
        lambda d: next(r["ns_per_has_data"] for r in d["hit"] if r["case"] == "group of 1"),
    ),
    Bench(
        "ring_wake",
        ("ring", "--records", "1000"),
        "ReaderGroup of 1 ring: publish to wake p50 us, 1 ms pace",
        True,
        lambda d: next(
            r["p50_us"] for r in d["handoff"] if r["case"] == "group of 1" and r["pace"] == "sleep"
        ),
    ),
    Bench(
        "gateway",
        tuple("gateway --levels 100 --duration 6 --ramp 1 --warmup 1".split()),
        "gateway CPU ms per stream-second, 100 streams",
        True,
        lambda d: d["levels"][0]["cpu_ms_per_stream_s"],
    ),
    Bench(
        "protocols",
        ("protocols", "--levels", "1"),
        "flush to first byte p50 ms, OpenAI HTTP, 1 session",
        True,
        lambda d: next(r["p50_ms"] for r in d["results"] if r["protocol"] == "openai_http"),
    ),
)


def commit_of(tree: Path) -> str:
    """The tree's commit (``+dirty`` with uncommitted changes): what the JSON records of it,
    not its path on this machine."""
    git = ["git", "-C", str(tree)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def command(tree: Path) -> list[str]:
    module = "orpheus_serve" if (tree / "orpheus_serve").is_dir() else "orchestrator.cli"
    return [sys.executable, "-m", module, "bench"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def tiny_server(tree: Path, model: Path, env: dict[str, str], log: Path) -> Iterator[str]:
    """The tree's server on loopback with the tiny model on CPU; stopped (SIGTERM) after."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [*command(tree)[:-1], "serve", "--model", str(model), "--codec-model",
             str(model / "snac"), "--device", "cpu", "--port", str(port)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(serve, cwd=tree, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 600
            while not _ready(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server of {tree} not ready: {log.read_text()[-3000:]}")
                time.sleep(1)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def run_one(tree: Path, bench: Bench, timeout_s: float, model: Path) -> float:
    with tempfile.TemporaryDirectory(prefix="ab-") as tmp, contextlib.ExitStack() as stack:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        extra: list[str] = []
        if bench.server:
            url = stack.enter_context(tiny_server(tree, model, env, Path(tmp) / "server.log"))
            extra = ["--url", url]
        res = subprocess.run(
            [*command(tree), *bench.args, *extra, "--json", str(out)],
            cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        if res.returncode != 0 or not out.exists():
            raise RuntimeError(
                f"{bench.name} in {tree} failed:\n{res.stdout[-2000:]}{res.stderr[-3000:]}"
            )
        return float(bench.extract(json.loads(out.read_text())))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, default=Path("."))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated benchmark names")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--model", type=Path, default=Path("tiny-model"),
                    help="the tiny model for the whole-server run (orpheus-serve tiny-model DIR)")  # fmt: skip
    args = ap.parse_args(argv)
    model = args.model.resolve()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    chosen = [b for b in BENCHES if not args.only or b.name in args.only.split(",")]
    raw: dict[str, dict[str, list[float]]] = {b.name: {"before": [], "after": []} for b in chosen}
    started = time.time()
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for b in chosen:
            for side in order:
                value = run_one(trees[side], b, args.timeout, model)
                raw[b.name][side].append(value)
                print(f"round {r + 1} {b.name:<10} {side:<6} {value:.4g}", flush=True)
    rows = []
    print(f"\n{'benchmark':<10} {'metric':<55} {'before':>9} {'after':>9} {'after/before':>12}")
    for b in chosen:
        before = statistics.median(raw[b.name]["before"])
        after = statistics.median(raw[b.name]["after"])
        ratio = after / before
        rows.append({"benchmark": b.name, "metric": b.metric, "lower_is_better": b.lower,
                     "before_median": before, "after_median": after, "ratio": ratio,
                     "before_runs": raw[b.name]["before"], "after_runs": raw[b.name]["after"]})  # fmt: skip
        print(f"{b.name:<10} {b.metric:<55} {before:>9.4g} {after:>9.4g} {ratio:>12.3f}")
    if args.json:
        doc = {"benchmark": "ab_components", "trees": {k: commit_of(v) for k, v in trees.items()},
               "rounds": args.rounds, "seconds": round(time.time() - started, 1),
               "machine": os.uname().nodename, "cpus": os.cpu_count(), "results": rows}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
