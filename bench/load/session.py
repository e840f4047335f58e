"""Run load levels against one server: the part ``bench load`` and ``bench compare`` share."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

import aiohttp
import msgspec
from rich.console import Console

from bench.load.clients import HttpSpeechClient, SpeechClient, ZmqSpeechClient
from bench.load.progress import LevelProgress
from bench.load.runner import LevelPlan, run_closed, run_open
from bench.load.search import CapacitySearch, SearchResult
from bench.load.summary import LevelResult, LevelRun, Slo, summarize
from bench.load.texts import Corpus


class LevelSpec(msgspec.Struct, frozen=True):
    mode: Literal["closed", "open"]
    value: float
    """Concurrency (closed loop) or arrivals per second (open loop)."""

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "closed" else f"{self.value:g}/s"


class Target(msgspec.Struct, frozen=True, kw_only=True):
    url: str = "http://127.0.0.1:8000"
    zmq: str | None = None
    api_key: str | None = None
    read_timeout_s: float = 60.0
    """A stream silent for this long is broken (clients give up after 3-30 s)."""
    use_cache: bool = False
    """Let the server's sentence audio cache answer repeated texts; False: every request
    says ``no-store`` (the benches measure synthesis, and their texts repeat)."""

    @property
    def name(self) -> str:
        return f"zmq {self.zmq}" if self.zmq else self.url

    def client(self) -> SpeechClient:
        if self.zmq:
            return ZmqSpeechClient(
                self.zmq,
                read_timeout_s=self.read_timeout_s,
                api_key=self.api_key,
                use_cache=self.use_cache,
            )
        return HttpSpeechClient(
            self.url,
            read_timeout_s=self.read_timeout_s,
            api_key=self.api_key,
            use_cache=self.use_cache,
        )


class NotReady(RuntimeError):
    pass


async def check_ready(url: str, timeout_s: float = 5.0) -> None:
    """Fail fast, with a clear message, when nothing healthy listens at ``url``."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.get(url.rstrip("/") + "/ready") as resp,
        ):
            if resp.status != 200:
                raise NotReady(f"{url}/ready answered {resp.status}")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise NotReady(f"no server ready at {url}: {exc}") from exc


async def offer_level(
    client: SpeechClient,
    spec: LevelSpec,
    plan: LevelPlan,
    corpus: Corpus,
    console: Console | None,
) -> LevelRun:
    """One level, with a live progress line on ``console``: its raw traces, unsummarized
    (``bench overload`` reads them its own way)."""
    progress = LevelProgress(console, spec.label, plan.max_requests) if console else None
    on_issue = progress.on_issue if progress is not None else None
    on_done = progress.on_done if progress is not None else None
    with progress if progress is not None else contextlib.nullcontext():
        if spec.mode == "closed":
            return await run_closed(
                client, int(spec.value), plan, corpus, on_issue=on_issue, on_done=on_done
            )
        return await run_open(client, spec.value, plan, corpus, on_issue=on_issue, on_done=on_done)


async def run_level(
    client: SpeechClient,
    spec: LevelSpec,
    plan: LevelPlan,
    corpus: Corpus,
    slo: Slo,
    console: Console | None,
) -> LevelResult:
    result = summarize(await offer_level(client, spec, plan, corpus, console), slo)
    if console is not None:
        console.print(
            f"{spec.label}: {result.ok}/{result.requests} ok, p99 TTFB "
            f"{result.ttfb_s.p99 * 1000:.0f} ms, p99 RTF {result.rtf.p99:.2f}, "
            f"{result.audio_s_per_s:.2f} audio-s/s, {result.underruns} underruns"
            + (" [red](deadline hit)" if result.deadline_hit else "")
        )
    return result


async def run_levels(
    target: Target,
    specs: list[LevelSpec],
    plan: LevelPlan,
    corpus: Corpus,
    slo: Slo,
    console: Console | None,
    *,
    pause_s: float = 1.0,
) -> list[LevelResult]:
    """Each level in turn on one client, with a short pause so one level's tail (cancelled
    fillers) does not leak into the next."""
    if target.zmq is None:
        await check_ready(target.url)
    client = target.client()
    results: list[LevelResult] = []
    try:
        for i, spec in enumerate(specs):
            if i:
                await asyncio.sleep(pause_s)
            results.append(await run_level(client, spec, plan, corpus, slo, console))
    finally:
        await client.aclose()
    return results


async def run_warmup_level(
    target: Target,
    concurrency: int,
    plan: LevelPlan,
    duration_s: float,
    corpus: Corpus,
    slo: Slo,
    console: Console | None,
) -> LevelResult:
    """A closed-loop level run before the first measured one and discarded, so that no
    start-up effect (a kernel compiled on its first batch, a cache filled, a stall) lands in
    a measured level. It lasts ``duration_s`` (plus its drain) instead of the plan's."""
    if console is not None:
        console.print(f"warm-up level c={concurrency} ({duration_s:g} s): results discarded")
    warm = msgspec.structs.replace(plan, duration_s=duration_s)
    (result,) = await run_levels(
        target, [LevelSpec("closed", concurrency)], warm, corpus, slo, console
    )
    return result


class SearchSpec(msgspec.Struct, frozen=True, kw_only=True):
    start: int = 8
    maximum: int = 1024
    resolution: float = 0.1


async def search_capacity(
    target: Target,
    spec: SearchSpec,
    plan: LevelPlan,
    corpus: Corpus,
    slo: Slo,
    console: Console | None,
    *,
    known: list[LevelResult],
) -> tuple[list[LevelResult], SearchResult]:
    """Bracketing capacity search; closed-loop levels already run (``known``) count as
    probes. Returns the levels it ran and the result."""
    if target.zmq is None:
        await check_ready(target.url)
    client = target.client()

    async def probe(concurrency: int) -> LevelResult:
        return await run_level(client, LevelSpec("closed", concurrency), plan, corpus, slo, console)

    search = CapacitySearch(probe, slo, resolution=spec.resolution)
    for level in known:
        if level.mode == "closed" and level.concurrency is not None:
            search.results[level.concurrency] = level
    try:
        found = await search.run(spec.start, spec.maximum)
    finally:
        await client.aclose()
    return [search.results[c] for c in found.probes], found
