"""``orpheus-serve bench protocols [--url URL] [--json FILE]``: time from the flush (the
client's last text piece) to the first audio byte, per client protocol, at 1 and 16
concurrent sessions.

Protocols: OpenAI HTTP (``POST /v1/audio/speech``, from the request), vLLM-Omni WebSocket
(from ``input.done``), ElevenLabs multi-context WebSocket (from the context's ``flush``),
ElevenLabs HTTP (from the request), Baseten's Orpheus WebSocket (from ``__END__``) and
its HTTP mode (``POST /v1/baseten/orpheus/predict``, from the request).
WebSocket sessions are connected and configured before the clock starts, as a voice agent
keeps its socket open across turns; the text goes out in pieces before the flush (none of
them ends a sentence, so nothing is spoken early). Each session speaks ``--rounds`` turns,
reading each turn's audio to its end before the next.

Without ``--url`` the command starts one gateway process (as served) in front of the
synthetic backend (``testkit.synthetic_backend``: real-time paced audio whose first chunk
comes ``--first-chunk-ms`` after the request, standing in for the model): the numbers are
then the protocols' own cost in the gateway, side by side. With ``--url`` it measures a
running server (e.g. ``orpheus-serve serve``), model included. Absolute times from a
shared machine drift; compare the protocols within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp

from bench.gateway.cpu import header
from bench.gateway.synthetic import SyntheticGateway
from bench.lib.report import show, table, write_json
from bench.lib.stats import percentile
from bench.load.clients import NO_STORE
from common.config import ServeConfig
from common.config.gateway import GatewayConfig
from common.config.text import TextConfig
from shm.config import ShmConfig

PROTOCOLS = (
    "openai_http",
    "omni_ws",
    "elevenlabs_ws",
    "elevenlabs_http",
    "baseten_ws",
    "baseten_http",
)
Turn = Callable[[int], Awaitable[float]]
"""Speaks turn ``i`` of a session; returns seconds from the flush to the first audio byte."""


def _pieces(i: int) -> list[str]:
    return ["Hi there, ", "this is ", f"turn {i}"]  # the flush adds the final "."


class _Session:
    """One client session of a protocol (a socket kept across turns where it has one)."""

    def __init__(self, proto: str, base: str, http: aiohttp.ClientSession, voice: str) -> None:
        self.proto = proto
        self.base = base
        self.ws_base = base.replace("http://", "ws://").replace("https://", "wss://")
        self.http = http
        self.voice = voice
        self.ws: aiohttp.ClientWebSocketResponse | None = None

    async def open(self) -> None:
        if self.proto == "omni_ws":
            self.ws = await self.http.ws_connect(self.ws_base + "/v1/audio/speech/stream")
            await self.ws.send_json({"type": "session.config", "voice": self.voice,
                                     "response_format": "pcm", "stream_audio": True})  # fmt: skip
        elif self.proto == "elevenlabs_ws":
            self.ws = await self.http.ws_connect(
                f"{self.ws_base}/v1/text-to-speech/{self.voice}/multi-stream-input"
                "?output_format=pcm_24000"
            )

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()

    async def turn(self, i: int) -> float:
        return await getattr(self, "_" + self.proto)(i)

    async def _http(self, url: str, body: dict[str, Any]) -> float:
        t0 = time.perf_counter()
        first = None
        async with self.http.post(url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{url}: {resp.status} {await resp.text()}")
            async for chunk in resp.content.iter_any():
                if first is None and chunk:
                    first = time.perf_counter() - t0
        if first is None:
            raise RuntimeError(f"{url}: no audio")
        return first

    async def _openai_http(self, i: int) -> float:
        text = "".join(_pieces(i)) + "."
        body = {"model": "tts-1", "input": text, "voice": self.voice, "response_format": "pcm"}
        return await self._http(self.base + "/v1/audio/speech", body)

    async def _elevenlabs_http(self, i: int) -> float:
        text = "".join(_pieces(i)) + "."
        url = f"{self.base}/v1/text-to-speech/{self.voice}/stream?output_format=pcm_24000"
        return await self._http(url, {"text": text, "model_id": "eleven_flash_v2_5"})

    async def _baseten_http(self, i: int) -> float:
        text = "".join(_pieces(i)) + "."
        body = {"prompt": text, "voice": self.voice, "temperature": 0.6, "language": "en"}
        return await self._http(self.base + "/v1/baseten/orpheus/predict", body)

    async def _omni_ws(self, i: int) -> float:
        ws = self.ws
        assert ws is not None
        for p in [*_pieces(i), "."]:
            await ws.send_json({"type": "input.text", "text": p})
        t0 = time.perf_counter()
        await ws.send_json({"type": "input.done"})
        first = None
        while True:
            msg = await ws.receive(120)
            if msg.type == aiohttp.WSMsgType.BINARY:
                if first is None:
                    first = time.perf_counter() - t0
            elif msg.type == aiohttp.WSMsgType.TEXT:
                ev = json.loads(msg.data)
                if ev["type"] == "error":
                    raise RuntimeError(f"omni: {ev['message']}")
                if ev["type"] == "session.done":
                    break
            else:
                raise RuntimeError(f"omni: socket closed ({msg.type})")
        if first is None:
            raise RuntimeError("omni: no audio")
        return first

    async def _elevenlabs_ws(self, i: int) -> float:
        ws = self.ws
        assert ws is not None
        cid = f"turn{i}"
        await ws.send_json({"text": " ", "context_id": cid})
        for p in [*_pieces(i), "."]:
            await ws.send_json({"text": p, "context_id": cid})
        t0 = time.perf_counter()
        await ws.send_json({"context_id": cid, "flush": True})
        await ws.send_json({"context_id": cid, "close_context": True})
        first = None
        while True:
            msg = await ws.receive(120)
            if msg.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"elevenlabs: socket closed ({msg.type})")
            ev = json.loads(msg.data)
            if "error" in ev:
                raise RuntimeError(f"elevenlabs: {ev['message']}")
            if ev.get("audio") and first is None:
                first = time.perf_counter() - t0
            if ev.get("isFinal"):
                break
        if first is None:
            raise RuntimeError("elevenlabs: no audio")
        return first

    async def _baseten_ws(self, i: int) -> float:
        async with self.http.ws_connect(self.ws_base + "/v1/baseten/orpheus/websocket") as ws:
            await ws.send_json({"voice": self.voice, "max_tokens": 2000, "buffer_size": 10})
            for p in [*_pieces(i), "."]:
                await ws.send_str(p)
            t0 = time.perf_counter()
            await ws.send_str("__END__")
            first = None
            async for msg in ws:
                if msg.type == aiohttp.WSMsgType.BINARY and first is None:
                    first = time.perf_counter() - t0
            if first is None:
                raise RuntimeError(f"baseten: no audio (close {ws.close_code})")
            return first


async def _level(base: str, proto: str, sessions: int, rounds: int, voice: str) -> list[float]:
    # no-store on every request and WebSocket upgrade: the sessions say the same turns, which
    # the sentence audio cache would answer; this bench measures the protocols' synthesis.
    async with aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=600), headers=NO_STORE
    ) as http:
        ss = [_Session(proto, base, http, voice) for _ in range(sessions)]
        await asyncio.gather(*(s.open() for s in ss))
        try:

            async def run(s: _Session) -> list[float]:
                return [await s.turn(i) for i in range(rounds)]

            per = await asyncio.gather(*(run(s) for s in ss))
        finally:
            await asyncio.gather(*(s.close() for s in ss), return_exceptions=True)
    return [x for xs in per for x in xs]


def _local_server(first_chunk_s: float, normalization: str = "on") -> SyntheticGateway:
    """A gateway process in front of the synthetic backend (another process)."""

    def configure(shm: ShmConfig, port: int, _run_dir: str) -> ServeConfig:
        return ServeConfig(
            device="cpu", log_level="WARNING", shm=shm,
            # A fixed count: the synthetic backend's pace is set here, not by the load.
            gateway=GatewayConfig(port=port, max_active_streams=256, playground=False,
                                  admission="fixed"),
            text=TextConfig(normalization=normalization),  # type: ignore[arg-type]
        )  # fmt: skip

    return SyntheticGateway(configure, first_chunk_delay_s=first_chunk_s)


def _stats(xs: list[float]) -> dict[str, float]:
    ms = [x * 1000 for x in xs]
    return {"n": len(xs), "p50_ms": round(percentile(ms, 50), 2),
            "p90_ms": round(percentile(ms, 90), 2), "max_ms": round(max(ms), 2)}  # fmt: skip


def _print_table(rows: list[dict[str, Any]], title: str) -> None:
    columns = ("protocol", "sessions", "turns", "p50 ms", "p90 ms", "max ms", "p50 / openai_http")
    cells = [
        (r["protocol"], str(r["sessions"]), str(r["n"]), f"{r['p50_ms']:.1f}",
         f"{r['p90_ms']:.1f}", f"{r['max_ms']:.1f}",
         "-" if r.get("p50_vs_openai_http") is None else f"{r['p50_vs_openai_http']:.2f}")
        for r in rows
    ]  # fmt: skip
    show(table(title, columns, cells), min_width=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orpheus-serve bench protocols", description=__doc__)
    ap.add_argument("--url", help="a running server (default: a local gateway + synthetic backend)")
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--levels", default="1,16", help="concurrent sessions per level")
    ap.add_argument("--rounds", type=int, default=3, help="turns per session")
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument("--voice", default="tara")
    ap.add_argument("--first-chunk-ms", type=float, default=50.0,
                    help="synthetic backend: delay of a stream's first audio")  # fmt: skip
    ap.add_argument("--text-normalization", choices=("on", "off"), default="on",
                    help="local gateway: text.normalization (each turn's text has a number)")  # fmt: skip
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    protocols = [p for p in args.protocols.split(",") if p]
    unknown = set(protocols) - set(PROTOCOLS)
    if unknown:
        ap.error(f"unknown protocols {sorted(unknown)}; choose from {', '.join(PROTOCOLS)}")
    env = header()
    machine = env["machine"]
    rows: list[dict[str, Any]] = []

    def measure(base: str) -> None:
        for n in levels:
            for proto in protocols:
                print(f"{proto}: {n} sessions ...", file=sys.stderr, flush=True)
                xs = asyncio.run(_level(base, proto, n, args.rounds, args.voice))
                rows.append({"protocol": proto, "sessions": n, **_stats(xs)})
            ref = next(
                (r for r in rows if r["sessions"] == n and r["protocol"] == "openai_http"), None
            )
            for r in rows:
                if r["sessions"] == n and ref is not None:
                    r["p50_vs_openai_http"] = round(r["p50_ms"] / ref["p50_ms"], 3)

    if args.url:
        measure(args.url.rstrip("/"))
        backend = f"the server at {args.url}"
    else:
        with _local_server(args.first_chunk_ms / 1000, args.text_normalization) as served:
            measure(served.url)
        backend = (f"one gateway process + synthetic backend (real-time paced, first chunk "
                   f"after {args.first_chunk_ms:g} ms)")  # fmt: skip
    machine["loadavg_after"] = os.getloadavg()
    title = f"bench protocols: flush -> first audio byte ({backend})"
    _print_table(rows, title)
    report = {
        "benchmark": "protocols",
        "description": "time from the flush (the last text piece; for HTTP the request) to "
        "the first audio byte, per protocol and number of concurrent sessions; WebSockets "
        "connected and configured before the clock starts",
        "backend": backend,
        **env,
        "config": {
            "levels": levels,
            "rounds": args.rounds,
            "protocols": protocols,
            "voice": args.voice,
            "first_chunk_ms": None if args.url else args.first_chunk_ms,
            "text_normalization": None if args.url else args.text_normalization,
        },
        "results": rows,
    }
    write_json(report, args.json, announce=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
