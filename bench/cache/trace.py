"""The sentence audio cache on the real server: a voice-agent trace with the cache used and
bypassed, side by side on one server in one run.

    orpheus-serve bench cache --model tiny-model --codec-model tiny-model/snac \\
        --json docs/results/cache_trace_cpu.json --plot docs/results/cache_trace_cpu.png

(``python -m bench.cache.trace`` the same.)

One server (the cache on, as by default; two API keys' worth of clients in the same key),
closed-loop clients each speaking voice-agent turns
(``bench.cache.policy.voice_agent_trace``'s sentences without the flood: a stock phrase of
50, Zipf, opening or closing two unique sentences) one sentence per ``POST
/v1/audio/speech``. The arms alternate in phases of ``--phase-s``: the ``on`` arm's requests
use the cache, the ``off`` arm's send ``Cache-Control: no-store`` (neither read nor written:
the server as it is without the cache), so both meet the same machine and the same model.
Per arm: requests, audio seconds delivered per second, time to first byte (request sent to
first body byte, at the client) p50/p99 by ``X-Cache`` (hit, miss), the hit ratio; the
cache's entries and bytes at the end (``/metrics``).

``--scenario seam``: a cached greeting opening a sentence never said before, one request
each, against the same with ``Cache-Control: no-store``: the gap where the cached audio ends
and the synthesised begins (``bench.cache.seam``).

``--scenario repeat``: the issue's closed-loop check instead, the ``repeat`` arm's clients
cycling through five sentences (cached after their second synthesis) against the
``unique`` arm's clients whose sentences never repeat, both using the cache; per arm also
the streams per second and the share of streams played in real time (a player that starts
100 ms after the first byte never runs dry).

The tiny model's random weights do not stop on their own: every request asks for
``max_tokens`` of 7 per 6 characters (a frame of 85 ms per 6 characters, about speech's
pace), so a sentence's audio length follows its text in both arms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

from bench.cache.policy import STOCK
from bench.lib.plot import pyplot, save
from bench.lib.report import environment, now_iso, write_json
from bench.lib.stats import percentile
from bench.load.servers import ORPHEUS_SERVE, ServerProcess, recorded_argv
from testkit.local_server import free_port

BYTES_PER_S = 48_000
KEY = "bench-cache"
JITTER_S = 0.1
"""A stream is real-time when a player that starts this long after its first byte never
runs dry."""
FIVE = [
    "Thank you for calling, how can I help you today?",
    "One moment please, let me look that up for you.",
    "Is there anything else I can help you with?",
    "Please hold while I transfer your call.",
    "Thank you for your patience, goodbye.",
]


def five(seed: int) -> Iterator[str]:
    """Five stock sentences, cycled (from a different one per client)."""
    i = seed
    while True:
        yield FIVE[i % len(FIVE)]
        i += 1


def unique(seed: int) -> Iterator[str]:
    """Sentences that never repeat, of the same lengths as ``FIVE``'s."""
    n = 0
    while True:
        n += 1
        base = FIVE[n % len(FIVE)]
        tag = f"{seed}-{n} "
        yield tag + base[len(tag) :]


def turns(seed: int) -> Iterator[str]:
    """Endless voice-agent turns: a stock phrase (Zipf s=1 over ``STOCK``) opening or closing
    two one-off sentences."""
    rng = random.Random(seed)
    weights = [1 / (r + 1) for r in range(len(STOCK))]
    n = 0
    while True:
        phrase = rng.choices(STOCK, weights)[0].strip()
        content = []
        for _ in range(2):
            n += 1
            content.append(f"Your reference {seed}-{n} is ready for pickup on aisle {n % 40}.")
        yield from ([phrase, *content] if rng.random() < 0.5 else [*content, phrase])


async def speak(
    s: aiohttp.ClientSession, url: str, text: str, use_cache: bool
) -> tuple[str, float, float, bool]:
    """(X-Cache, TTFB s, audio s, played in real time) of one sentence."""
    headers = {"Authorization": f"Bearer {KEY}"}
    if not use_cache:
        headers["Cache-Control"] = "no-store"
    body = {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm",
            "max_tokens": 7 * max(1, len(text) // 6)}  # fmt: skip
    t0 = time.perf_counter()
    ttfb = None
    n = 0
    realtime = True
    async with s.post(url + "/v1/audio/speech", json=body, headers=headers) as r:
        r.raise_for_status()
        state = "off" if not use_cache else r.headers.get("X-Cache", "none")
        async for chunk in r.content.iter_any():
            now = time.perf_counter() - t0
            if ttfb is None:
                ttfb = now
            # Before this chunk, the player (started JITTER_S after the first byte) must
            # not have played past what had arrived.
            if now - ttfb - JITTER_S > n / BYTES_PER_S:
                realtime = False
            n += len(chunk)
    return state, ttfb if ttfb is not None else float("nan"), n / BYTES_PER_S, realtime


Result = tuple[str, float, float, bool]


async def run_phase(
    url: str, clients: int, seconds: float, use_cache: bool, sources: list[Any]
) -> list[Result]:
    out: list[Result] = []
    end = time.perf_counter() + seconds

    async def client(i: int) -> None:
        async with aiohttp.ClientSession() as s:
            while time.perf_counter() < end:
                out.append(await speak(s, url, next(sources[i]), use_cache))

    await asyncio.gather(*(client(i) for i in range(clients)))
    return out


def pct(xs: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) of seconds, in ms; None of nothing."""
    return round(percentile(xs, q) * 1000, 1) if xs else None


def summarise(results: list[Result], seconds: float) -> dict[str, Any]:
    by: dict[str, list[float]] = {}
    for state, ttfb, _, _ in results:
        by.setdefault(state, []).append(ttfb)
    audio = sum(a for _, _, a, _ in results)
    hits = len(by.get("hit", []))
    return {
        "requests": len(results),
        "streams_per_s": round(len(results) / seconds, 3),
        "realtime_ratio": round(sum(rt for *_, rt in results) / len(results), 3)
        if results
        else None,
        "audio_s_per_s": round(audio / seconds, 3),
        "realtime_audio_s_per_s": round(sum(a for _, _, a, rt in results if rt) / seconds, 3),
        "hit_ratio": round(hits / len(results), 3) if results else None,
        "ttfb_ms": {
            k: {
                "n": len(v),
                "p50": pct(v, 50),
                "p99": pct(v, 99),
                "mean": round(statistics.fmean(v) * 1000, 1),
            }
            for k, v in sorted(by.items())
        },
    }


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--codec-model", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=30.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--scenario", choices=["trace", "repeat", "seam"], default="trace")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args(argv)
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        # The cache as configured by default (on), its entries in this run's directory.
        extra = ["--set", f'gateway.api_keys=["{KEY}"]', "--set", "gateway.admission=fixed",
                 "--set", f"cache.dir={tmp}/entries"]  # fmt: skip
        argv_ = [ORPHEUS_SERVE, "serve", "--model", args.model, "--codec-model",
                 args.codec_model, "--device", args.device, "--host", "127.0.0.1",
                 "--port", str(port), *extra]  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        with ServerProcess("orpheus-serve", argv_, url, Path(tmp) / "server.log") as srv:
            srv.wait_ready(600)
            if args.scenario == "seam":
                return seam_main(args, url, argv)
            if args.scenario == "trace":
                names, uses = ("on", "off"), {"on": True, "off": False}
                sources = {arm: [turns(100 * i + j) for i in range(args.clients)]
                           for j, arm in enumerate(names)}  # fmt: skip
            else:
                names, uses = ("repeat", "unique"), {"repeat": True, "unique": True}
                sources = {"repeat": [five(i) for i in range(args.clients)],
                           "unique": [unique(i) for i in range(args.clients)]}  # fmt: skip
            arms: dict[str, list[Result]] = {arm: [] for arm in names}
            load = []
            for _ in range(args.rounds):
                for arm in names:
                    res = asyncio.run(
                        run_phase(url, args.clients, args.phase_s, uses[arm], sources[arm])
                    )
                    arms[arm] += res
                    load.append(os.getloadavg()[0])
                    print(f"{arm}: {summarise(res, args.phase_s)}", file=sys.stderr)
            with aiohttp_get(url + "/metrics") as text:
                entries = metric(text, "orpheus_gateway_cache_entries")
                cache_bytes = metric(text, "orpheus_gateway_cache_bytes")
            seconds = args.phase_s * args.rounds
            report = {
                "benchmark": "cache trace",
                "date": now_iso(),
                **environment({"load_average_1m_per_phase": [round(x, 2) for x in load]}),
                "command": recorded_argv(
                    [sys.executable, "-m", "bench.cache.trace", *(argv or sys.argv[1:])]
                ),
                "scenario": args.scenario,
                "clients": args.clients,
                "phase_s": args.phase_s,
                "rounds": args.rounds,
                "arms": {arm: summarise(res, seconds) for arm, res in arms.items()},
                "cache_entries_at_end": entries,
                "cache_bytes_at_end": cache_bytes,
            }
    write_json(report, args.json, announce=sys.stderr)
    if args.plot is not None:
        plot(report, args.plot)
    print(report["arms"])
    return 0


def seam_main(args: argparse.Namespace, url: str, argv: list[str] | None) -> int:
    """``--scenario seam`` on the server at ``url``: its table, JSON and plot."""
    from bench.cache import seam

    command = recorded_argv([sys.executable, "-m", "bench.cache.trace", *(argv or sys.argv[1:])])
    report = seam.report(url, KEY, args.clients, args.phase_s, args.rounds, command)
    write_json(report, args.json, announce=sys.stderr)
    if args.plot is not None:
        seam.plot(report.requests, args.plot)
    seam.show_table(report.arms, f"bench cache --scenario seam: {args.clients} clients an arm")
    return 0


class aiohttp_get:
    """``with aiohttp_get(url) as text``: one GET, synchronously (between the phases)."""

    def __init__(self, url: str) -> None:
        import urllib.request

        with urllib.request.urlopen(url, timeout=10) as r:
            self.text = r.read().decode()

    def __enter__(self) -> str:
        return self.text

    def __exit__(self, *_: object) -> None:
        return None


def plot(report: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels, p50, p99 = [], [], []
    for arm, r in report["arms"].items():
        for state, t in r["ttfb_ms"].items():
            labels.append(f"{arm}\n{state} (n={t['n']})")
            p50.append(t["p50"])
            p99.append(t["p99"])
    x = range(len(labels))
    ax1.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    ax1.set_xticks(list(x), labels)
    ax1.set_ylabel("time to first byte (ms)")
    ax1.set_yscale("log")
    ax1.legend()
    arms = list(report["arms"])
    ax2.bar(arms, [report["arms"][a]["audio_s_per_s"] for a in arms])
    ax2.set_ylabel("audio seconds delivered per second")
    fig.suptitle(f"sentence audio cache, {report['clients']} closed-loop clients (CPU, tiny model)")
    fig.tight_layout()
    save(fig, path, dpi=100)


if __name__ == "__main__":
    sys.exit(main())
