"""What a single flight's log costs a gateway process: N leader streams, each pushing one
chunk per codec window at real-time pace into its ``FlightRelay`` (``gateway.cache.relay``)
for a while, on one event loop with the relay's real flight thread and real files.

    PYTHONPATH=. python scripts/dev/flight_relay_cost.py --streams 100,500 --seconds 10 \\
        --json docs/results/flight_relay_cost_cpu.json

Arms, alternated per level: ``none`` (no relay: the loop only paces), ``per-chunk`` (each
push hands one write to the flight thread: a submit and a future per chunk, the relay's
first version) and ``batched`` (the relay as it is: a push appends to the process's one
queue, ``FlightWrites``, and one drain at a time takes every leader's queued chunks, each
leader's in one write). Reported: the process's CPU seconds per
second (loop and flight thread together, ``time.process_time``) and the loop's own time in
the pushes, per second.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gateway.cache.relay import FlightRelay, FlightWrites
from shm.records import StreamEnd

CHUNK_BYTES = 4096
"""One codec window of 2,048 samples, int16: 85 ms of audio at 24 kHz."""
WINDOW_S = 2048 / 24_000


class PerChunkRelay(FlightRelay):
    """The relay's first version: one hand-off to the flight thread per chunk."""

    def push(self, data: bytes) -> None:
        if not self.ended:
            self._submit(self.append, [data])


async def level(arm: str, streams: int, seconds: float) -> dict[str, object]:
    root = Path(tempfile.mkdtemp(prefix="flight-cost-"))
    io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flight")
    failures: list[str] = []
    try:
        kind = {"none": None, "per-chunk": PerChunkRelay, "batched": FlightRelay}[arm]
        writes = FlightWrites(io)
        relays = [
            kind(writes, root, f"{i:032x}", lambda w, e: failures.append(f"{w}: {e}"))
            for i in range(streams)
            if kind is not None
        ]
        await asyncio.get_running_loop().run_in_executor(io, lambda: None)  # logs claimed
        chunk = bytes(CHUNK_BYTES)
        # Streams start spread over one window, then each pushes a chunk every window.
        start = time.monotonic()
        due = [start + WINDOW_S * i / streams for i in range(streams)]
        pushed = 0
        push_s = 0.0
        cpu0 = time.process_time()
        while (now := time.monotonic()) - start < seconds:
            t0 = time.perf_counter()
            for i in range(streams):
                while due[i] <= now:
                    if relays:
                        relays[i].push(chunk)
                    pushed += 1
                    due[i] += WINDOW_S
            push_s += time.perf_counter() - t0
            await asyncio.sleep(0.005)
        for r in relays:
            r.done(StreamEnd("stop", 0))
        await asyncio.get_running_loop().run_in_executor(io, lambda: None)  # all written
        wall = time.monotonic() - start
        cpu = time.process_time() - cpu0
        written = sum(p.stat().st_size for p in root.iterdir()) if relays else 0
    finally:
        io.shutdown(wait=True)
        shutil.rmtree(root, ignore_errors=True)
    assert not failures, failures
    return {
        "arm": arm,
        "streams": streams,
        "chunks_per_s": round(pushed / wall, 1),
        "cpu_s_per_s": round(cpu / wall, 4),
        "loop_push_s_per_s": round(push_s / wall, 4),
        "bytes_written": written,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", default="100,500")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    rows = []
    for streams in [int(s) for s in a.streams.split(",")]:
        for r in range(a.rounds):
            for arm in ("none", "per-chunk", "batched"):
                row = asyncio.run(level(arm, streams, a.seconds)) | {"round": r + 1}
                rows.append(row)
                print(
                    f"{streams:5d} streams, round {r + 1}, {arm:9s}: "
                    f"{row['chunks_per_s']:8.1f} chunks/s, CPU {row['cpu_s_per_s']:.4f} s/s, "
                    f"loop in pushes {row['loop_push_s_per_s']:.4f} s/s",
                    flush=True,
                )
    if a.json:
        cmd = f"scripts/dev/flight_relay_cost.py --streams {a.streams} --seconds {a.seconds:g} --rounds {a.rounds}"
        a.json.write_text(json.dumps({"command": cmd, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
