"""A server's start and its first wave, two source trees alternated: each start's time to
/ready (``tests/harness/e2e_harness.start_server``, the tiny model on the CPU), then N
concurrent OpenAI streams sent at once, each one's first byte. For changes to what happens
before ready (the warm-up), where the question is what the first users meet.

    .venv/bin/python scripts/dev/first_wave.py --tree before=../wt-base --tree after=. \\
        --pairs 3 --streams 16 --json docs/results/cpu_warmup_rows_ab.json

Each tree runs with itself first on PYTHONPATH (the environment's editable install points
at one checkout). Needs ``runs/tiny-model`` in each tree (``orpheus-serve tiny-model``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FRAMES = 12


def one_start(streams: int) -> dict[str, object]:
    """In the tree's own process (cwd and PYTHONPATH the tree's)."""
    import aiohttp

    sys.path[:0] = ["tests/harness", "tests", "."]
    from e2e_harness import start_server, stop_server

    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"first-wave-{os.getpid()}.log"
    with open(log_path, "wb") as log:
        t = time.monotonic()
        srv = start_server(Path("runs/tiny-model"), log=log)
        ready = time.monotonic() - t

        async def stream(s: aiohttp.ClientSession, i: int) -> float:
            body = {"model": "tts-1", "input": f"First wave stream number {i}.", "voice": "tara",
                    "response_format": "pcm", "max_tokens": 7 * FRAMES}  # fmt: skip
            t0 = time.perf_counter()
            async with s.post(srv.url + "/v1/audio/speech", json=body) as r:
                assert r.status == 200, await r.text()
                await r.content.readany()
                first = time.perf_counter() - t0
                await r.read()
            return first

        async def wave() -> list[float]:
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(stream(s, i) for i in range(streams)))

        try:
            firsts = sorted(asyncio.run(wave()))
        finally:
            stop_server(srv)
    text = log_path.read_text(errors="replace")
    log_path.unlink()
    warm = [ln.split("engine ", 1)[1].strip() for ln in text.splitlines() if "engine warm-up" in ln]
    return {"ready_s": round(ready, 2), "warm_up": warm[0] if warm else None,
            "ttfb_ms": [round(x * 1000) for x in firsts]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one_start(a.streams)))
        return 0
    trees = [t.split("=", 1) for t in a.tree]
    if len(trees) < 1 or any(len(t) != 2 for t in trees):
        p.error("--tree NAME=PATH, once per tree")
    runs = []
    # The servers' state directories (start_server's cache and jobs dirs) and logs go here.
    tmp = tempfile.mkdtemp(prefix="first-wave-")
    try:
        return _alternate(a, trees, runs, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alternate(
    a: argparse.Namespace, trees: list[list[str]], runs: list[dict[str, object]], tmp: str
) -> int:
    for pair in range(a.pairs):
        for name, path in trees:
            root = Path(path).resolve()
            env = dict(os.environ, PYTHONPATH=str(root), TMPDIR=tmp)
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--one", "--streams", str(a.streams)],
                env=env, cwd=root, capture_output=True, text=True, check=False,
            )  # fmt: skip
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
            if out.returncode or not lines:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            run = {"pair": pair + 1, "arm": name, **json.loads(lines[-1])}
            runs.append(run)
            ttfb = run["ttfb_ms"]
            print(f"pair {pair + 1} {name}: ready {run['ready_s']} s, {run['warm_up']}, "
                  f"first byte p50 {ttfb[len(ttfb) // 2]} ms, max {ttfb[-1]} ms", flush=True)  # fmt: skip
    if a.json:
        command = (
            "scripts/dev/first_wave.py "
            + " ".join(f"--tree {n}" for n, _ in trees)
            + f" --pairs {a.pairs} --streams {a.streams}"
        )
        a.json.write_text(
            json.dumps({"command": command, "frames": FRAMES, "runs": runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
