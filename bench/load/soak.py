"""``orpheus-serve bench soak``: a bounded soak of a real server under a mix of client
behaviour, watching for hung streams and for growth (memory, file descriptors, /dev/shm).

Examples::

    orpheus-serve bench soak --model tiny-model --duration 180 --json docs/results/soak_cpu.json
    orpheus-serve bench soak --url http://127.0.0.1:8000 --pid 1234 --duration 600

``--model`` starts the server (on CPU by default) and stops it at the end; ``--url`` with
``--pid`` (the orchestrator's pid) soaks a running one. For ``--duration`` seconds,
``--users`` concurrent users each run one scenario after another, picked at random:

- ``complete``: an HTTP stream read to its end; its audio length is checked;
- ``disconnect``: an HTTP stream dropped by the client at a random point;
- ``ws_cancel``: a vLLM-Omni WebSocket session closed by the client after some audio (a
  barge-in: the generation is cancelled into vLLM);
- ``slow_reader``: an HTTP stream read in small pieces with pauses (a slow network);
- ``bad_request``: an invalid request (unknown voice, empty input, bad JSON): must be 400;

and every ``--flood-every`` seconds a ``flood`` of ``--flood-size`` simultaneous short
requests past admission: each must be served (200) or refused (429/503 with Retry-After).

A stream that gets no byte for ``--hang-s`` seconds is *hung* (there must be none). Every
``--interval`` seconds the RSS and open file descriptors of every process of the instance,
the instance's /dev/shm bytes, and the p99 TTFB of the streams started in that interval are
sampled. Output: a table, JSON (``--json``) and a PNG (``--plot``).

Random weights make noise, not speech: this measures the server, not the voice.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec

from bench.environment import Machine, Versions, machine, versions
from bench.load.cli import add_output_arguments
from bench.load.growth import GrowthCheck, check_growth, default_warmup_s
from bench.load.probe_growth import ProbeGrowth, print_probe, summarize
from bench.report import write_json
from common.memory_probe import ENV as PROBE_ENV
from common.memory_probe import EVERY_ENV as PROBE_EVERY_ENV
from orchestrator import proctree
from shm.ring import SHM_DIR

BYTES_PER_FRAME = 2048 * 2
WS_REFUSALS = {"server_busy": 429, "queue_timeout": 429, "draining": 503, "workers_not_ready": 503}
"""Error codes with which the gateway refuses a stream it cannot admit (and their HTTP status)."""
SCENARIOS = {
    "complete": 4,
    "disconnect": 2,
    "ws_cancel": 2,
    "slow_reader": 1,
    "bad_request": 1,
}
SLOW_READ_BYTES = 2048
SLOW_READ_PAUSE_S = 0.1
"""A slow reader takes 20 KB/s: 0.43x the audio's 48 KB/s."""
SETTLE_S = 20.0
"""Traffic stopped, then this long before the end sample: the server finishes what
cancelled and disconnected streams left, and vLLM's CPU processes, which hand free heap
memory back every ``llm.cpu_heap_trim_s`` (15 s), hand back the last flood's."""
OUTCOMES = ("ok", "disconnected", "cancelled", "refused", "rejected", "failed", "hung")


# -- results ----------------------------------------------------------------------------------
class SoakStream(msgspec.Struct, kw_only=True):
    scenario: str
    started: float
    """Seconds since the soak began."""
    outcome: str = "failed"
    status: int | None = None
    ttfb_s: float | None = None
    audio_bytes: int = 0
    duration_s: float = 0.0
    detail: str = ""


class ProcSample(msgspec.Struct, frozen=True):
    name: str
    pid: int
    rss_bytes: int
    fds: int
    shmem_bytes: int = 0
    """The part of ``rss_bytes`` that is shared memory (the rings' pages this process has
    touched: bounded by the ring sizes, and counted once in the instance's /dev/shm)."""


class Sample(msgspec.Struct, frozen=True, kw_only=True):
    t_s: float
    processes: list[ProcSample]
    rss_bytes: int
    fds: int
    shm_bytes: int
    """Bytes of the instance's /dev/shm segments and of those its processes map."""
    shm_total_bytes: int
    """All of /dev/shm (machine-wide: other jobs share it)."""
    shm_segments: int = 0
    """How many /dev/shm segments the instance has (its own and those its processes map)."""
    shm_size_bytes: int = 0
    """Their apparent sizes (``shm_bytes`` counts only the pages touched so far)."""
    streams: int
    """Streams started in the interval that ended here."""
    ttfb_p99_s: float | None
    ttfb_p50_s: float | None


class SoakReport(msgspec.Struct, kw_only=True):
    kind: str = "soak"
    created: str
    duration_s: float
    users: int
    flood_size: int
    flood_every_s: float
    hang_s: float
    url: str
    outcomes: dict[str, dict[str, int]]
    """scenario -> outcome -> count."""
    hung: int
    streams: int
    samples: list[Sample]
    start: Sample
    end: Sample
    growth: dict[str, float]
    """end - start: rss_mb, fds, shm_mb (the instance's)."""
    after_warmup: GrowthCheck | None = None
    """Growth per process after the warm-up, with the bounds it was judged by."""
    probe: list[ProbeGrowth] | None = None
    """With ``--profile-memory``: what each process's memory probe saw after the warm-up."""
    failures: list[str]
    """Details of the first streams whose outcome was not the expected one."""
    machine: Machine
    versions: Versions
    note: str = "random weights: the audio is noise; this measures the server, not the voice"


# Any HTTP request may be refused (429/503 with Retry-After) while a flood fills admission.
EXPECTED = {
    "complete": {"ok", "refused"},
    "disconnect": {"disconnected", "ok", "refused"},
    "ws_cancel": {"cancelled", "ok", "refused"},
    "slow_reader": {"ok", "refused"},
    "bad_request": {"rejected", "refused"},  # admission is decided before the voice is read
    "flood": {"ok", "refused"},
}


# -- process sampling -------------------------------------------------------------------------
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
    ordered = sorted(ttfbs)
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
        ttfb_p99_s=_pct(ordered, 0.99),
        ttfb_p50_s=_pct(ordered, 0.5),
    )


def _pct(ordered: list[float], q: float) -> float | None:
    if not ordered:
        return None
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4)


# -- clients ----------------------------------------------------------------------------------
class Soak:
    def __init__(self, args: argparse.Namespace, url: str, instance: str) -> None:
        self.args = args
        self.url = url.rstrip("/")
        self.instance = instance
        self.rng = random.Random(args.seed)
        self.t0 = time.monotonic()
        self.started_at = time.time()
        """The start in epoch seconds (the memory probe's clock)."""
        self.deadline = self.t0 + args.duration
        self.streams: list[SoakStream] = []
        self.window_ttfbs: list[float] = []
        self.samples: list[Sample] = []
        self.texts = [
            "The soak test keeps the server busy for a while.",
            "Short one.",
            "A somewhat longer sentence, so that the stream lasts more than a second or two.",
        ]

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _body(self, frames: int) -> dict[str, object]:
        return {
            "model": "tts-1",
            "input": self.rng.choice(self.texts),
            "voice": self.rng.choice(["tara", "alloy", "nova"]),
            "response_format": "pcm",
            "max_tokens": 7 * frames,
            "seed": self.rng.randrange(1 << 30),
        }

    def _got_first(self, s: SoakStream, t_sent: float) -> None:
        if s.ttfb_s is None:
            s.ttfb_s = round(time.monotonic() - t_sent, 4)
            self.window_ttfbs.append(s.ttfb_s)

    async def _read_http(
        self,
        session: aiohttp.ClientSession,
        s: SoakStream,
        frames: int,
        *,
        stop_after: int | None = None,
        slow: bool = False,
    ) -> None:
        t_sent = time.monotonic()
        hang = self.args.hang_s
        async with session.post(f"{self.url}/v1/audio/speech", json=self._body(frames)) as r:
            s.status = r.status
            if r.status != 200:
                s.outcome = "refused" if r.status in (429, 503) else "failed"
                if s.outcome == "refused" and "Retry-After" not in r.headers:
                    s.outcome, s.detail = "failed", f"{r.status} without Retry-After"
                elif s.outcome == "failed":
                    s.detail = (await r.text())[:200]
                return
            while True:
                try:
                    async with asyncio.timeout(hang):
                        piece = await r.content.read(SLOW_READ_BYTES if slow else 65536)
                except TimeoutError:
                    s.outcome, s.detail = "hung", f"no byte for {hang:.0f}s"
                    return
                if not piece:
                    break
                self._got_first(s, t_sent)
                s.audio_bytes += len(piece)
                if stop_after is not None and s.audio_bytes >= stop_after:
                    s.outcome = "disconnected"
                    return  # leaving the context closes the connection mid-stream
                if slow:
                    await asyncio.sleep(SLOW_READ_PAUSE_S)
            if s.audio_bytes == frames * BYTES_PER_FRAME:
                s.outcome = "ok"
            else:
                s.outcome = "failed"
                s.detail = f"{s.audio_bytes} bytes, expected {frames * BYTES_PER_FRAME}"

    async def _ws_cancel(self, session: aiohttp.ClientSession, s: SoakStream, frames: int) -> None:
        """vLLM-Omni's streaming protocol at /v1/audio/speech/stream: a barge-in is the client
        closing the socket after some audio, which cancels the generation into vLLM."""
        t_sent = time.monotonic()
        hang = self.args.hang_s
        body = self._body(frames)
        config = {"type": "session.config", "voice": body["voice"], "response_format": "pcm",
                  "stream_audio": True, "split_granularity": "none"}  # fmt: skip
        async with session.ws_connect(f"{self.url}/v1/audio/speech/stream") as ws:
            await ws.send_str(json.dumps(config))
            await ws.send_str(json.dumps({"type": "input.text", "text": body["input"]}))
            await ws.send_str('{"type": "input.done"}')
            cancel_after = self.rng.randint(1, 4) * BYTES_PER_FRAME
            while True:
                try:
                    msg = await ws.receive(timeout=hang)
                except TimeoutError:
                    s.outcome, s.detail = "hung", f"no message for {hang:.0f}s"
                    return
                if msg.type == aiohttp.WSMsgType.BINARY:
                    self._got_first(s, t_sent)
                    s.audio_bytes += len(msg.data)
                    if s.audio_bytes >= cancel_after:
                        await ws.close()  # the barge-in
                        s.status, s.outcome = 200, "cancelled"
                        return
                elif msg.type == aiohttp.WSMsgType.TEXT:
                    data = json.loads(msg.data)
                    kind = data.get("type")
                    if kind == "error":
                        s.detail = str(data)[:200]
                        if data.get("code") in WS_REFUSALS:
                            s.outcome, s.status = "refused", WS_REFUSALS[data["code"]]
                            return
                    elif kind in ("audio.done", "session.done"):
                        if data.get("error"):
                            s.outcome = "failed"
                            return
                        if kind == "session.done" or s.audio_bytes:
                            s.status, s.outcome = 200, "ok"
                            return
                else:
                    s.outcome = "failed"
                    s.detail = f"closed {ws.close_code} {s.detail}".strip()
                    return

    async def _bad_request(self, session: aiohttp.ClientSession, s: SoakStream) -> None:
        kind = self.rng.choice(["voice", "empty", "json"])
        url = f"{self.url}/v1/audio/speech"
        if kind == "json":
            req = session.post(url, data=b"{not json", headers={"Content-Type": "application/json"})
        else:
            body = self._body(4)
            body["voice" if kind == "voice" else "input"] = (
                "no-such-voice" if kind == "voice" else ""
            )
            req = session.post(url, json=body)
        async with req as r:
            s.status = r.status
            refused = r.status in (429, 503) and "Retry-After" in r.headers
            s.outcome = "rejected" if r.status == 400 else "refused" if refused else "failed"
            s.detail = kind if r.status == 400 else f"{kind}: {r.status}"

    async def run_one(self, session: aiohttp.ClientSession, scenario: str) -> None:
        s = SoakStream(scenario=scenario, started=round(self.now(), 2))
        t = time.monotonic()
        frames = self.rng.randint(self.args.min_frames, self.args.max_frames)
        try:
            if scenario == "complete":
                await self._read_http(session, s, frames)
            elif scenario == "slow_reader":
                await self._read_http(session, s, frames, slow=True)
            elif scenario == "disconnect":
                stop = self.rng.randint(1, max(1, frames - 1)) * BYTES_PER_FRAME
                await self._read_http(session, s, frames, stop_after=stop)
            elif scenario == "ws_cancel":
                await self._ws_cancel(session, s, max(frames, 8))
            elif scenario == "bad_request":
                await self._bad_request(session, s)
            elif scenario == "flood":
                await self._read_http(session, s, 2)
        except (aiohttp.ClientError, TimeoutError, ConnectionError) as exc:
            s.outcome, s.detail = "failed", f"{type(exc).__name__}: {exc}"[:200]
        s.duration_s = round(time.monotonic() - t, 3)
        self.streams.append(s)

    async def user(self, session: aiohttp.ClientSession) -> None:
        names, weights = list(SCENARIOS), list(SCENARIOS.values())
        while time.monotonic() < self.deadline:
            await self.run_one(session, self.rng.choices(names, weights)[0])

    async def flooder(self, session: aiohttp.ClientSession) -> None:
        every = self.args.flood_every
        while True:
            await asyncio.sleep(every)
            if time.monotonic() >= self.deadline:
                return
            n = self.args.flood_size
            await asyncio.gather(*(self.run_one(session, "flood") for _ in range(n)))

    async def sampler(self) -> None:
        while True:
            await asyncio.sleep(self.args.interval)
            ttfbs, self.window_ttfbs = self.window_ttfbs, []
            sample = await asyncio.to_thread(sample_instance, self.instance, self.now(), ttfbs)
            self.samples.append(sample)
            print(_sample_line(sample), flush=True)
            if time.monotonic() >= self.deadline:
                return

    async def traffic(self, session: aiohttp.ClientSession) -> None:
        """The soak's requests: ``--users`` users and the floods, until the deadline."""
        flooder = asyncio.create_task(self.flooder(session))
        await asyncio.gather(*(self.user(session) for _ in range(self.args.users)))
        flooder.cancel()
        await asyncio.gather(flooder, return_exceptions=True)

    async def run(self) -> tuple[Sample, Sample]:
        start = sample_instance(self.instance, 0.0, [])
        print(_sample_line(start), flush=True)
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        # no-store: the soak measures the synthesis path's leaks, and a cached answer (or
        # a sighting in the server's state directory) is not what it runs for.
        async with aiohttp.ClientSession(
            connector=connector, timeout=timeout, headers={"Cache-Control": "no-store"}
        ) as session:
            sampler = asyncio.create_task(self.sampler())
            await self.traffic(session)
            await sampler
        # Let the server finish what the cancelled/disconnected streams left, then look.
        await asyncio.sleep(self.args.settle_s)
        end = sample_instance(self.instance, self.now(), [])
        print(_sample_line(end), flush=True)
        return start, end


def _sample_line(s: Sample) -> str:
    p99 = f"{s.ttfb_p99_s * 1000:7.0f}" if s.ttfb_p99_s is not None else "      -"
    return (
        f"t={s.t_s:6.0f}s  streams {s.streams:4d}  TTFB p99 {p99} ms  RSS {s.rss_bytes / 1e6:7.0f} MB"
        f"  fds {s.fds:5d}  /dev/shm {s.shm_bytes / 1e6:6.1f} MB  ({len(s.processes)} processes)"
    )


# -- report -----------------------------------------------------------------------------------
def build_report(soak: Soak, start: Sample, end: Sample) -> SoakReport:
    table: dict[str, dict[str, int]] = {}
    for name in [*SCENARIOS, "flood"]:
        counts = Counter(s.outcome for s in soak.streams if s.scenario == name)
        table[name] = {o: counts.get(o, 0) for o in OUTCOMES}
    failures = [
        f"{s.scenario} at {s.started:.0f}s: {s.outcome} {s.status} {s.detail}"
        for s in soak.streams
        if s.outcome not in EXPECTED[s.scenario]
    ][:50]
    a = soak.args
    warmup = a.warmup if a.warmup is not None else default_warmup_s(a.duration)
    return SoakReport(
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        duration_s=a.duration,
        users=a.users,
        flood_size=a.flood_size,
        flood_every_s=a.flood_every,
        hang_s=a.hang_s,
        url=soak.url,
        outcomes=table,
        hung=sum(1 for s in soak.streams if s.outcome == "hung"),
        streams=len(soak.streams),
        samples=soak.samples,
        start=start,
        end=end,
        growth={
            "rss_mb": round((end.rss_bytes - start.rss_bytes) / 1e6, 1),
            "fds": float(end.fds - start.fds),
            "shm_mb": round((end.shm_bytes - start.shm_bytes) / 1e6, 2),
        },
        failures=failures,
        after_warmup=check_growth(
            [start, *soak.samples, end],
            warmup,
            bound_pct=a.growth_bound_pct,
            floor_mb=a.growth_floor_mb,
            floors_mb=dict(a.growth_floor),
        ),
        probe=(
            summarize(a.profile_memory, soak.started_at + warmup)
            if a.profile_memory is not None
            else None
        ),
        machine=machine(),
        versions=versions(),
    )


def print_growth(g: GrowthCheck) -> None:
    print(f"\nprivate RSS (RSS less shared ring pages) after the warm-up ({g.warmup_s:.0f} s), over "
          f"the last {g.window_s:.0f} s: the lowest in the first {g.level_window_s:.0f} s against "
          f"the lowest in the last {g.level_window_s:.0f} s; bound: {g.bound_pct:g}% of the "
          f"first, at least {g.floor_mb:g} MB"
          + "".join(f", {name}: {mb:g} MB" for name, mb in g.floors_mb.items()))  # fmt: skip
    print(f"{'process':28s} {'at warm-up MB':>14s} {'end MB':>8s} {'peak MB':>8s} "
          f"{'growth MB':>10s} {'%':>6s} {'MB/h':>8s} {'bound MB':>9s}")  # fmt: skip
    for p in g.processes:
        flag = "" if p.ok else "  <- over"
        print(f"{p.name:28s} {p.base_mb:14.1f} {p.end_mb:8.1f} {p.peak_mb:8.1f} "
              f"{p.growth_mb:+10.1f} {p.growth_pct:+6.1f} {p.slope_mb_per_h:+8.1f} "
              f"{p.bound_mb:9.1f}{flag}")  # fmt: skip
    print(f"fds {g.fds_growth:+d}; /dev/shm {g.shm_segments_growth:+d} segments, "
          f"{g.shm_size_growth_mb:+.1f} MB")  # fmt: skip
    if g.passed:
        print("growth: PASS (every process within its bound; fds and /dev/shm flat)")
    for line in g.problems:
        print(f"growth: FAIL: {line}")


def _by_name(sample: Sample) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for p in sample.processes:
        rss, fds = out.get(p.name, (0, 0))
        out[p.name] = (rss + p.rss_bytes, fds + p.fds)
    return out


def print_report(r: SoakReport) -> None:
    print(f"\nsoak: {r.duration_s:.0f}s, {r.users} users, flood of {r.flood_size} every "
          f"{r.flood_every_s:.0f}s; {r.streams} streams; hung: {r.hung}")  # fmt: skip
    print(f"{'scenario':12s}" + "".join(f"{o:>13s}" for o in OUTCOMES))
    for name, counts in r.outcomes.items():
        print(f"{name:12s}" + "".join(f"{counts[o]:13d}" for o in OUTCOMES))
    print(f"\n{'process':28s} {'RSS start MB':>13s} {'RSS end MB':>11s} {'fds start':>10s} "
          f"{'fds end':>8s}")  # fmt: skip
    s, e = _by_name(r.start), _by_name(r.end)
    for name in sorted(set(s) | set(e)):
        rs, fs = s.get(name, (0, 0))
        re_, fe = e.get(name, (0, 0))
        print(f"{name:28s} {rs / 1e6:13.0f} {re_ / 1e6:11.0f} {fs:10d} {fe:8d}")
    print(f"{'total':28s} {r.start.rss_bytes / 1e6:13.0f} {r.end.rss_bytes / 1e6:11.0f} "
          f"{r.start.fds:10d} {r.end.fds:8d}")  # fmt: skip
    print(f"/dev/shm (instance): {r.start.shm_bytes / 1e6:.1f} MB -> {r.end.shm_bytes / 1e6:.1f} MB;"
          f" machine-wide {r.start.shm_total_bytes / 1e6:.1f} -> {r.end.shm_total_bytes / 1e6:.1f} MB")  # fmt: skip
    print("\np99 TTFB over time:")
    for smp in r.samples:
        p99 = f"{smp.ttfb_p99_s * 1000:.0f} ms" if smp.ttfb_p99_s is not None else "-"
        print(f"  t={smp.t_s:5.0f}s  {smp.streams:4d} streams  p99 {p99}")
    if r.after_warmup is not None:
        print_growth(r.after_warmup)
    if r.probe is not None:
        print_probe(r.probe)
    if r.failures:
        print(f"\nunexpected outcomes ({len(r.failures)} shown):")
        for f in r.failures[:10]:
            print(f"  {f}")


def plot_report(r: SoakReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [r.start, *r.samples, r.end]
    t = [s.t_s for s in samples]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4), constrained_layout=True)
    ax = axes[0]
    pts = [(s.t_s, s.ttfb_p99_s * 1000) for s in r.samples if s.ttfb_p99_s is not None]
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="p99")
    pts50 = [(s.t_s, s.ttfb_p50_s * 1000) for s in r.samples if s.ttfb_p50_s is not None]
    if pts50:
        ax.plot([p[0] for p in pts50], [p[1] for p in pts50], "s--", label="p50")
    ax.set(title="TTFB per interval", xlabel="time (s)", ylabel="ms")
    ax.legend()
    ax = axes[1]
    names = sorted({p.name for s in samples for p in s.processes})
    for name in names:
        ax.plot(t, [_by_name(s).get(name, (0, 0))[0] / 1e6 for s in samples], label=name)
    ax.plot(t, [s.rss_bytes / 1e6 for s in samples], "k-", lw=2, label="total")
    if r.after_warmup is not None:
        ax.axvline(r.after_warmup.warmup_s, color="grey", ls=":", label="end of warm-up")
    ax.set(title="RSS by process", xlabel="time (s)", ylabel="MB")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.plot(t, [s.fds for s in samples], "b-", label="open fds")
    ax.set(title="open fds and /dev/shm", xlabel="time (s)", ylabel="fds")
    ax2 = ax.twinx()
    ax2.plot(t, [s.shm_bytes / 1e6 for s in samples], "r-", label="/dev/shm MB (instance)")
    ax2.set_ylabel("MB")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    fig.suptitle(f"soak {r.duration_s:.0f}s: {r.streams} streams, hung {r.hung} (random weights)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- command ----------------------------------------------------------------------------------
@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored on leaving."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _name_mb(text: str) -> tuple[str, float]:
    name, sep, mb = text.rpartition("=")
    try:
        if not (sep and name):
            raise ValueError
        return name, float(mb)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=MB, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orpheus-serve bench soak", description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="start a server on this model (tiny model: DIR/snac used)")
    where.add_argument("--url", help="soak a running server (needs --pid)")
    p.add_argument("--pid", type=int, help="orchestrator pid of the running server (--url)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--users", type=int, default=4, help="concurrent users (default 4)")
    p.add_argument("--flood-size", type=int, default=160, help="requests per flood")
    p.add_argument("--flood-every", type=float, default=60.0, help="seconds between floods")
    p.add_argument("--interval", type=float, default=15.0, help="sampling period (s)")
    p.add_argument("--hang-s", type=float, default=60.0, help="no byte this long: hung")
    p.add_argument(
        "--settle-s",
        type=float,
        default=SETTLE_S,
        help=f"wait before the end sample ({SETTLE_S:g})",
    )
    p.add_argument("--min-frames", type=int, default=6)
    p.add_argument("--max-frames", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before growth is judged (default: half the duration, at most 900)",
    )
    p.add_argument(
        "--growth-bound-pct",
        type=float,
        default=2.0,
        help="a process may grow this %% of its RSS at warm-up (default 2)",
    )
    p.add_argument(
        "--growth-floor-mb",
        type=float,
        default=8.0,
        help="... or this many MB if more (default 8: small processes' noise)",
    )
    p.add_argument(
        "--growth-floor",
        action="append",
        default=[],
        type=_name_mb,
        metavar="NAME=MB",
        help="the floor of the processes named NAME instead (repeatable), e.g. a process "
        "whose free heap moves by design",
    )
    add_output_arguments(p, progress=False)
    p.add_argument("--server-log", type=Path, default=Path("runs/soak-server.log"))
    p.add_argument(
        "--profile-memory",
        type=Path,
        metavar="DIR",
        help="with --model: every process of the server samples its own memory into DIR "
        "(common/memory_probe.py: smaps, glibc's heap, the collector's objects)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url and args.pid is None:
        print("orpheus-serve bench soak: --url needs --pid (the orchestrator's)", file=sys.stderr)
        return 2
    if args.url and args.profile_memory is not None:
        print("orpheus-serve bench soak: --profile-memory needs --model (the probe is started "
              f"with the server; for a running one, set {PROBE_ENV} when starting it)",
              file=sys.stderr)  # fmt: skip
        return 2
    warmup = args.warmup if args.warmup is not None else default_warmup_s(args.duration)
    if warmup > args.duration - 2 * args.interval:
        print(f"orpheus-serve bench soak: a warm-up of {warmup:.0f} s leaves fewer than two "
              f"samples (every {args.interval:.0f} s) of a {args.duration:.0f} s run to judge "
              "growth by", file=sys.stderr)  # fmt: skip
        return 2
    server = None
    if args.model:
        from bench.doubles.local_server import free_port
        from bench.load.servers import ServerProcess, orpheus_serve_argv

        port = free_port()
        # A fixed admission count: the soak judges memory over a traffic mix whose floods fill
        # admission's queue, as every soak before learned admission did (comparable runs);
        # learned admission has its own bench (``bench overload``).
        fixed = ["--set", "gateway.admission=fixed"]
        argv_ = orpheus_serve_argv(args.model, None, args.device, port, fixed)
        url = f"http://127.0.0.1:{port}"
        server = ServerProcess("orpheus-serve", argv_, url, args.server_log)
        probe = {PROBE_ENV: str(args.profile_memory), PROBE_EVERY_ENV: str(args.interval)}
        with _environment(probe if args.profile_memory is not None else {}):
            server.start()  # the server's processes inherit it; this one is left as it was
        server.wait_ready(900)
        assert server.pid is not None
        pid = server.pid
        print(f"server ready in {server.ready_after_s:.0f}s (log: {args.server_log})")
    else:
        url, pid = args.url, args.pid
    try:
        soak = Soak(args, url, f"orpheus-{pid}")
        start, end = asyncio.run(soak.run())
    finally:
        if server is not None:
            server.stop()
    report = build_report(soak, start, end)
    print_report(report)
    write_json(report, args.json, announce=sys.stdout)
    if args.plot:
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        plot_report(report, args.plot)
        print(f"wrote {args.plot}")
    unexpected = sum(1 for s in soak.streams if s.outcome not in EXPECTED[s.scenario])
    grew = report.after_warmup is not None and not report.after_warmup.passed
    print(f"soak: {'FAIL' if report.hung or unexpected or grew else 'PASS'}: {report.hung} hung, "
          f"{unexpected} unexpected outcomes, growth after warm-up "
          f"{'over its bound' if grew else 'within bounds'}")  # fmt: skip
    return 1 if report.hung or unexpected or grew else 0


if __name__ == "__main__":
    sys.exit(main())
