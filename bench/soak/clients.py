"""The soak's users: each runs one scenario after another against the server, with a flood
of short requests now and then and the instance sampled at every interval."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

import aiohttp

from bench.soak.results import (
    BYTES_PER_FRAME,
    SCENARIOS,
    SLOW_READ_BYTES,
    SLOW_READ_PAUSE_S,
    WS_REFUSALS,
    Sample,
    SoakStream,
)
from bench.soak.sampling import sample_instance


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
