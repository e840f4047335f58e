"""``bench cache --scenario seam``: the seam between a request's cached first sentence and
its synthesised rest, against the same requests with the cache bypassed.

Each request is one ``POST /v1/audio/speech`` of a greeting (one of ``bench.cache.trace``'s
``FIVE``) followed by a sentence never said before. The ``cached`` arm's greetings are in
the cache (each spoken alone until it is a hit: the node stores a unit on its second
synthesis), so its requests are ``X-Cache: partial``: the greeting's audio at once, the rest
synthesised by a worker stream submitted when the request starts. The ``no-store`` arm's
requests send ``Cache-Control: no-store``: the whole text synthesised, as without the cache.
The arms alternate in phases of ``--phase-s`` on one server.

Per arm: requests, time to first byte p50/p99, the share of streams a player with a 100 ms
jitter buffer plays without an underrun (``bench.load.playback``), and the seam: the
greeting's audio is a known number of bytes (its hit's length), so the client finds where
the cached part ends in the stream. The gap is the time from the read that completed the
greeting's bytes to the first read carrying a byte after them (0 when one read held both);
the margin is how long before a player (started 100 ms after the first byte) needs that
byte it came (negative: the seam is heard as a pause). The ``no-store`` arm's figures are
taken at the same byte offset, a point in the middle of one synthesis.

Requests carry no ``max_tokens`` (a partial lookup is not made with one, it fixes the whole
text's length): a text's audio is as long as the model makes it, up to the server's length
cap for its characters (``llm.max_tokens_per_char``). The tiny model's random weights end a
text at random, so its five greetings' audio differs in length (0.2 to 4.1 s on CPU) and
each arm is also summarised by the greeting's audio length: the head start the cached part
gives the rest.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from bench.cache.trace import FIVE
from bench.lib.plot import pyplot, save
from bench.lib.report import environment, now_iso, show, table
from bench.lib.stats import percentile
from bench.load.playback import analyze_playback

BYTES_PER_S = 48_000
JITTER_S = 0.1
ARMS = ("cached", "no-store")
WARM_TRIES = 6


class Speech(msgspec.Struct, frozen=True, kw_only=True):
    """One request, as its client saw it."""

    x_cache: str
    ttfb_s: float
    audio_s: float
    underruns: int
    prefix_bytes: int
    """The greeting's audio length (its hit's), where the seam is looked for."""
    seam_gap_s: float | None
    """From the read completing ``prefix_bytes`` to the first read after them; None when
    the stream ended at or before them."""
    seam_margin_s: float | None
    """How long before a player (started ``JITTER_S`` after the first byte) needed the first
    byte after the greeting it came; negative: late."""


class Ms(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds, summarised in ms, on their bad side: a delay's p99 and largest, a margin's
    p1 and smallest."""

    n: int
    p50: float | None
    tail: float | None
    worst: float | None


class GreetingSummary(msgspec.Struct, frozen=True, kw_only=True):
    """An arm's requests opening with greetings of one audio length."""

    requests: int
    playable_ratio: float
    seam_margin_ms: Ms


class ArmSummary(msgspec.Struct, frozen=True, kw_only=True):
    requests: int
    x_cache: dict[str, int]
    """``X-Cache`` values seen, counted."""
    ttfb_ms: Ms
    playable_ratio: float | None
    """Streams with no underrun behind a 100 ms jitter buffer."""
    seam_gap_ms: Ms
    seam_margin_ms: Ms
    audio_s_per_s: float
    by_greeting_s: dict[str, GreetingSummary]
    """By the greeting's audio length in seconds (its cached part's, in the cached arm)."""


def sentence(seed: int) -> Iterator[str]:
    """Sentences never said before (``seed`` apart per client and arm)."""
    n = 0
    while True:
        n += 1
        yield f"Your reference {seed}-{n} is ready for pickup on aisle {n % 40}."


def seam(
    times: list[float], sizes: list[int], prefix: int, first: float
) -> tuple[float | None, float | None]:
    """(gap, margin) at byte ``prefix`` of a stream read as ``sizes[i]`` bytes at
    ``times[i]``; ``first``: the first byte's time. (None, None): nothing came after it."""
    done = None
    got = 0
    for t, n in zip(times, sizes, strict=True):
        got += n
        if done is None and got >= prefix:
            done = t
        if done is not None and got > prefix:
            return t - done, first + JITTER_S + prefix / BYTES_PER_S - t
    return None, None


async def speak(
    s: aiohttp.ClientSession, url: str, key: str, text: str, no_store: bool
) -> tuple[str, list[float], list[int], float]:
    """(X-Cache, read times, read sizes, sent at) of one request, on one clock."""
    headers = {"Authorization": f"Bearer {key}"}
    if no_store:
        headers["Cache-Control"] = "no-store"
    body = {"model": "tts-1", "input": text, "voice": "tara", "response_format": "pcm"}
    times: list[float] = []
    sizes: list[int] = []
    t0 = time.perf_counter()
    async with s.post(url + "/v1/audio/speech", json=body, headers=headers) as r:
        r.raise_for_status()
        state = r.headers.get("X-Cache", "none")
        async for chunk in r.content.iter_any():
            times.append(time.perf_counter())
            sizes.append(len(chunk))
    return state, times, sizes, t0


def measure(state: str, times: list[float], sizes: list[int], t0: float, prefix: int) -> Speech:
    """One request's figures from its reads."""
    play = analyze_playback(times, sizes, jitter_buffer_s=JITTER_S)
    gap, margin = seam(times, sizes, prefix, times[0]) if times else (None, None)
    return Speech(
        x_cache=state,
        ttfb_s=times[0] - t0 if times else float("nan"),
        audio_s=sum(sizes) / BYTES_PER_S,
        underruns=play.underruns,
        prefix_bytes=prefix,
        seam_gap_s=gap,
        seam_margin_s=margin,
    )


async def warm(url: str, key: str, greetings: list[str]) -> dict[str, int]:
    """Each greeting spoken alone until it is a hit (stored on its second synthesis);
    its audio's length in bytes."""
    lengths: dict[str, int] = {}
    async with aiohttp.ClientSession() as s:
        for g in greetings:
            for _ in range(WARM_TRIES):
                state, _, sizes, _ = await speak(s, url, key, g, no_store=False)
                if state == "hit":
                    lengths[g] = sum(sizes)
                    break
                await asyncio.sleep(0.2)  # the store is written after the stream ends
            else:
                raise RuntimeError(f"greeting {g!r} not cached after {WARM_TRIES} sayings")
    return lengths


async def run_phase(
    url: str,
    key: str,
    seconds: float,
    no_store: bool,
    sources: list[Iterator[str]],
    lengths: dict[str, int],
) -> list[Speech]:
    """Closed-loop clients, one per source, for ``seconds``."""
    greetings = list(lengths)
    out: list[Speech] = []
    end = time.perf_counter() + seconds

    async def client(i: int) -> None:
        n = i
        async with aiohttp.ClientSession() as s:
            while time.perf_counter() < end:
                g = greetings[n % len(greetings)]
                n += 1
                got = await speak(s, url, key, f"{g} {next(sources[i])}", no_store)
                out.append(measure(*got, lengths[g]))

    await asyncio.gather(*(client(i) for i in range(len(sources))))
    return out


def ms(xs: list[float], *, low: bool = False) -> Ms:
    """p50, p99 and the largest of seconds, in ms; ``low`` (a margin): p1 and the smallest."""
    if not xs:
        return Ms(n=0, p50=None, tail=None, worst=None)
    tail, worst = (percentile(xs, 1), min(xs)) if low else (percentile(xs, 99), max(xs))
    return Ms(n=len(xs), p50=_ms(percentile(xs, 50)), tail=_ms(tail), worst=_ms(worst))


def _ms(x: float) -> float:
    return round(x * 1000, 1)


def _playable(results: list[Speech]) -> float:
    return round(sum(r.underruns == 0 for r in results) / len(results), 3)


def by_greeting(results: list[Speech]) -> dict[str, GreetingSummary]:
    """``results`` grouped by the greeting's audio length (seconds, 2 decimals)."""
    groups: dict[int, list[Speech]] = {}
    for r in results:
        groups.setdefault(r.prefix_bytes, []).append(r)
    return {
        f"{n / BYTES_PER_S:.2f}": GreetingSummary(
            requests=len(rs),
            playable_ratio=_playable(rs),
            seam_margin_ms=ms(
                [r.seam_margin_s for r in rs if r.seam_margin_s is not None], low=True
            ),
        )
        for n, rs in sorted(groups.items())
    }


def summarise(results: list[Speech], seconds: float) -> ArmSummary:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.x_cache] = counts.get(r.x_cache, 0) + 1
    gaps = [r.seam_gap_s for r in results if r.seam_gap_s is not None]
    margins = [r.seam_margin_s for r in results if r.seam_margin_s is not None]
    return ArmSummary(
        requests=len(results),
        x_cache=dict(sorted(counts.items())),
        ttfb_ms=ms([r.ttfb_s for r in results]),
        playable_ratio=_playable(results) if results else None,
        seam_gap_ms=ms(gaps),
        seam_margin_ms=ms(margins, low=True),
        audio_s_per_s=round(sum(r.audio_s for r in results) / seconds, 3),
        by_greeting_s=by_greeting(results),
    )


def run_arms(
    url: str, key: str, clients: int, phase_s: float, rounds: int, greetings: list[str]
) -> tuple[dict[str, list[Speech]], list[float], dict[str, int]]:
    """Warm the greetings, then the arms in alternating phases: (each arm's requests, the
    load average after each phase, the greetings' audio bytes)."""
    lengths = asyncio.run(warm(url, key, greetings))
    sources = {arm: [sentence(100 * j + i) for i in range(clients)]
               for j, arm in enumerate(ARMS)}  # fmt: skip
    arms: dict[str, list[Speech]] = {arm: [] for arm in ARMS}
    load = []
    for _ in range(rounds):
        for arm in ARMS:
            res = asyncio.run(
                run_phase(url, key, phase_s, arm == "no-store", sources[arm], lengths)
            )
            arms[arm] += res
            load.append(os.getloadavg()[0])
            print(f"{arm}: {len(res)} requests", file=sys.stderr)
    return arms, load, lengths


def _cell(m: Ms) -> str:
    return "-" if m.p50 is None else f"{m.p50:.0f} / {m.tail:.0f} / {m.worst:.0f}"


def _row(arm: str, a: ArmSummary) -> list[str]:
    return [
        arm,
        str(a.requests),
        ", ".join(f"{k} {v}" for k, v in a.x_cache.items()),
        "-" if a.ttfb_ms.p50 is None else f"{a.ttfb_ms.p50:.0f} / {a.ttfb_ms.tail:.0f}",
        "-" if a.playable_ratio is None else f"{100 * a.playable_ratio:.0f} %",
        _cell(a.seam_gap_ms),
        _cell(a.seam_margin_ms),
    ]


def show_table(arms: dict[str, ArmSummary], title: str) -> None:
    """The arms side by side (rich)."""
    cols = ["arm", "requests", "X-Cache", "TTFB p50 / p99 ms", "playable (100 ms)",
            "seam gap p50 / p99 / max ms", "seam margin p50 / p1 / least ms"]  # fmt: skip
    rows = [_row(arm, a) for arm, a in arms.items()]
    by_cols = ["arm", "greeting s", "requests", "playable (100 ms)",
               "seam margin p50 / p1 / least ms"]  # fmt: skip
    by = [
        [arm, length, str(g.requests), f"{100 * g.playable_ratio:.0f} %", _cell(g.seam_margin_ms)]
        for arm, a in arms.items()
        for length, g in a.by_greeting_s.items()
    ]
    show(
        table(title, cols, rows, left={"arm", "X-Cache"}),
        table("by the greeting's audio length", by_cols, by, left={"arm"}),
    )


def plot(arms: dict[str, list[Speech]], path: Path) -> None:
    """Each request's seam gap and margin, by arm."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, res in arms.items():
        ax1.plot([1000 * r.seam_gap_s for r in res if r.seam_gap_s is not None], "o", label=arm)
        ax2.plot(
            [1000 * r.seam_margin_s for r in res if r.seam_margin_s is not None], "o", label=arm
        )
    ax1.set_ylabel("gap at the seam (ms)")
    ax2.set_ylabel("margin at the seam (ms, < 0: heard)")
    ax2.axhline(0, color="grey", lw=0.8)
    for ax in (ax1, ax2):
        ax.set_xlabel("request")
        ax.legend()
    fig.suptitle("cached greeting + synthesised sentence, against no-store (CPU, tiny model)")
    fig.tight_layout()
    save(fig, path, dpi=100)


class SeamReport(msgspec.Struct, frozen=True, kw_only=True):
    benchmark: str
    date: str
    machine: dict[str, Any]
    versions: dict[str, Any]
    command: list[str]
    scenario: str
    clients: int
    phase_s: float
    rounds: int
    jitter_buffer_s: float
    seam_found_by: str
    """How the seam is found in a stream (the greeting's byte count, not a proxy)."""
    greeting_bytes: dict[str, int]
    load_average_1m_per_phase: list[float]
    arms: dict[str, ArmSummary]
    requests: dict[str, list[Speech]]


def report(
    url: str, key: str, clients: int, phase_s: float, rounds: int, command: list[str]
) -> SeamReport:
    """The scenario on the server at ``url``, summarised, with each request's figures."""
    arms, load, lengths = run_arms(url, key, clients, phase_s, rounds, list(FIVE))
    return SeamReport(
        benchmark="cache seam",
        date=now_iso(),
        **environment(),
        command=command,
        scenario="seam",
        clients=clients,
        phase_s=phase_s,
        rounds=rounds,
        jitter_buffer_s=JITTER_S,
        seam_found_by="byte count of the greeting's cached audio (its hit's length)",
        greeting_bytes=lengths,
        load_average_1m_per_phase=[round(x, 2) for x in load],
        arms={arm: summarise(res, phase_s * rounds) for arm, res in arms.items()},
        requests=arms,
    )
