"""``orpheus-serve say``: synthesize one utterance through a running server into a WAV file."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import wave
from typing import NamedTuple

from shm.records import SAMPLE_RATE


async def _say_http(args: argparse.Namespace) -> tuple[bytes, float | None, float]:
    import aiohttp

    body: dict[str, object] = {
        "model": "orpheus",
        "input": args.text,
        "voice": args.voice,
        "response_format": "pcm",
    }
    if args.max_tokens is not None:
        body["max_tokens"] = args.max_tokens
    if args.seed is not None:
        body["seed"] = args.seed
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pcm = bytearray()
    ttfb: float | None = None
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(f"{args.url}/v1/audio/speech", json=body, headers=headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"server answered {resp.status}: {await resp.text()}")
            async for chunk in resp.content.iter_any():
                if ttfb is None and chunk:
                    ttfb = time.perf_counter() - t0
                pcm += chunk
    return bytes(pcm), ttfb, time.perf_counter() - t0


async def _say_zmq(args: argparse.Namespace) -> tuple[bytes, float | None, float]:
    from orpheus_client.zmq_client import AsyncClient

    pcm = bytearray()
    ttfb: float | None = None
    t0 = time.perf_counter()
    async with AsyncClient(args.zmq, api_key=args.api_key) as client:
        async for chunk in client.speech(
            args.text, voice=args.voice, max_tokens=args.max_tokens, seed=args.seed
        ):
            if ttfb is None and chunk:
                ttfb = time.perf_counter() - t0
            pcm += chunk
    return bytes(pcm), ttfb, time.perf_counter() - t0


class Speech(NamedTuple):
    pcm: bytes
    """16-bit little-endian mono at :data:`SAMPLE_RATE`."""
    ttfb_s: float | None
    """Seconds from the request to the first audio byte (None: no audio came)."""
    total_s: float

    @property
    def audio_s(self) -> float:
        return len(self.pcm) / 2 / SAMPLE_RATE

    @property
    def rtf(self) -> float:
        return self.total_s / self.audio_s if self.audio_s else float("inf")

    def summary(self) -> str:
        ttfb = f"{self.ttfb_s * 1000:.0f} ms" if self.ttfb_s is not None else "n/a"
        return (
            f"{self.audio_s:.2f} s of audio; TTFB {ttfb}; total {self.total_s:.2f} s; "
            f"RTF {self.rtf:.2f}"
        )


def synthesize(args: argparse.Namespace) -> Speech:
    """One utterance through a running server (``args``: those of ``orpheus-serve say``)."""
    runner = _say_zmq if args.zmq else _say_http
    return Speech(*asyncio.run(runner(args)))


def write_wav(path: str, pcm: bytes) -> None:
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)


def say(args: argparse.Namespace) -> int:
    try:
        speech = synthesize(args)
    except Exception as exc:  # a CLI reports failures as one line
        print(f"orpheus-serve say: {exc}", file=sys.stderr)
        return 1
    write_wav(args.output, speech.pcm)
    print(f"wrote {args.output}: {speech.summary()}")
    return 0
