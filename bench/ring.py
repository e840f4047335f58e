"""``orpheus-serve bench ring [--json FILE]``: what the shared-memory ring's wait costs.

The codec worker sleeps in ``ReaderGroup.wait`` (every engine's code ring at once) and the
gateway's and the codec's producers ring a doorbell only when their consumer said it sleeps
(``shm.ring``). This measures the consumer's side, in-process against a producer process:

- *hand-off*: a producer process publishes one record at a time (its payload the publish
  time), at a *sleep* pace (one a millisecond: the consumer spins, then sleeps on the
  doorbell) and a *spin* pace (one every 20 µs, busy-waited: the consumer mostly finds it
  while spinning). Reported: publish to ``wait`` returning, p50 and p99 in µs, and the
  consumer's CPU per record (spinning included).
- *hit*: ``wait`` when a record is already there (the common case under load), and
  ``has_data`` (the codec's loop asks it before every sleep), ns a call, best of the runs.

Each for ``RingReader.wait`` alone, a ``ReaderGroup`` of one ring and one of three rings (the
producer writes to them in turn). Rings live in /dev/shm under a name of this process, and
are removed at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.lib.report import environment, now_iso, show, table, write_json
from shm.config import ShmConfig
from shm.layout import InstanceLayout, RingEndpoints
from shm.ring import ReaderGroup, RingReader, RingWriter, create_ring, unlink_ring

RING_BYTES = 1 << 20
STAMP = struct.Struct("<q")
PACES = {"sleep": 1e-3, "spin": 20e-6}
"""Seconds between the producer's records."""
KINDS = (("reader", 1), ("group of 1", 1), ("group of 3", 3))


def produce(
    endpoints: list[RingEndpoints], records: int, interval_s: float, go: Any, done: Any
) -> None:
    """The producer process: one record a publish, stamped with ``perf_counter_ns`` (the
    system's monotonic clock, the same in every process), into the rings in turn."""
    writers = [RingWriter(ep) for ep in endpoints]
    try:
        go.wait()
        busy = interval_s < 200e-6  # time.sleep cannot wait this little
        due = time.perf_counter()
        for i in range(records):
            due += interval_s
            if busy:
                while time.perf_counter() < due:
                    pass
            else:
                time.sleep(max(0.0, due - time.perf_counter()))
            w = writers[i % len(writers)]
            w.try_append(1, i, i, STAMP.pack(time.perf_counter_ns()))
            w.publish()
        done.wait(30)  # the consumer has read everything: the rings may go
    finally:
        for w in writers:
            w.close()


@contextmanager
def rings(n: int, spin_us: int, recheck_ms: int) -> Iterator[list[RingReader]]:
    run_dir = tempfile.mkdtemp(prefix="orpheus-bench-ring-")
    layout = InstanceLayout(f"orpheus-{os.getpid()}-bring{os.urandom(2).hex()}", run_dir)
    os.makedirs(layout.socket_dir)
    eps = [layout.engine_code_ring(e) for e in range(n)]
    readers: list[RingReader] = []
    try:
        for ep in eps:
            create_ring(ep, RING_BYTES)
            readers.append(RingReader(ep, spin_us=spin_us, recheck_ms=recheck_ms))
        yield readers
    finally:
        for r in readers:
            r.close()
        for ep in eps:
            unlink_ring(ep)
        shutil.rmtree(run_dir, ignore_errors=True)  # the doorbells' ipc files


def waiter(kind: str, readers: list[RingReader]) -> Callable[[float], bool]:
    return readers[0].wait if kind == "reader" else ReaderGroup(readers).wait


def handoff(
    kind: str, n_rings: int, pace: str, records: int, spin_us: int, recheck_ms: int
) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    go, done = ctx.Event(), ctx.Event()
    with rings(n_rings, spin_us, recheck_ms) as readers:
        wait = waiter(kind, readers)
        eps = [r.endpoints for r in readers]
        proc = ctx.Process(target=produce, args=(eps, records, PACES[pace], go, done))
        proc.start()
        try:
            time.sleep(0.3)  # the producer's doorbells connected
            lat: list[int] = []
            go.set()
            cpu0 = time.process_time()
            deadline = time.monotonic() + 60
            while len(lat) < records:
                if not wait(1.0) and time.monotonic() > deadline:
                    raise RuntimeError(f"{kind}: {len(lat)} of {records} records in 60 s")
                now = time.perf_counter_ns()
                for r in readers:
                    recs = r.poll()
                    if recs:
                        lat.extend(now - STAMP.unpack(rec.payload)[0] for rec in recs)
                        r.release()
            cpu = time.process_time() - cpu0
            done.set()
        finally:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
    lat.sort()
    return {
        "case": kind,
        "rings": n_rings,
        "pace": pace,
        "records": records,
        "p50_us": round(lat[len(lat) // 2] / 1000, 1),
        "p99_us": round(lat[int(0.99 * (len(lat) - 1))] / 1000, 1),
        "cpu_us_per_record": round(cpu / records * 1e6, 2),
    }


def per_call_ns(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """ns a call, the best of ``repeats`` runs (on a shared machine the others measure its
    load); the garbage collector stays on, as in the workers."""
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - t0) / calls)
    return round(min(runs), 1)


def hit(kind: str, n_rings: int, calls: int, repeats: int) -> dict[str, Any]:
    """``wait`` with a record already published (in the last ring): the check that returns
    at once; and ``has_data``, which the codec's loop asks before every sleep."""
    with rings(n_rings, ShmConfig().spin_us, ShmConfig().recheck_ms) as readers:
        writer = RingWriter(readers[-1].endpoints)
        try:
            writer.try_append(1, 0, 0, b"x" * 8)
            writer.publish()
            wait = waiter(kind, readers)
            has_data = readers[0].has_data if kind == "reader" else ReaderGroup(readers).has_data
            return {
                "case": kind,
                "rings": n_rings,
                "ns_per_wait": per_call_ns(lambda: wait(1.0), calls, repeats),
                "ns_per_has_data": per_call_ns(has_data, calls, repeats),
            }
        finally:
            writer.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orpheus-serve bench ring", description=__doc__)
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--records", type=int, default=1500, help="records a hand-off case")
    ap.add_argument("--calls", type=int, default=100_000, help="waits a hit run")
    ap.add_argument("--repeats", type=int, default=7, help="hit runs (the best is kept)")
    shm = ShmConfig()
    ap.add_argument(
        "--spin-us", type=int, default=shm.spin_us, help="the consumer's spin (shm.spin_us)"
    )
    ap.add_argument("--recheck-ms", type=int, default=shm.recheck_ms, help="shm.recheck_ms")
    args = ap.parse_args(argv)

    handoffs = [
        handoff(kind, n, pace, args.records, args.spin_us, args.recheck_ms)
        for pace in PACES
        for kind, n in KINDS
    ]
    hits = [hit(kind, n, args.calls, args.repeats) for kind, n in KINDS]
    show(
        table(
            f"ring hand-off: publish to wait() returning ({args.records} records a case)",
            ["case", "rings", "pace", "p50 µs", "p99 µs", "consumer CPU µs/record"],
            [
                [
                    r["case"],
                    str(r["rings"]),
                    r["pace"],
                    f"{r['p50_us']:.1f}",
                    f"{r['p99_us']:.1f}",
                    f"{r['cpu_us_per_record']:.2f}",
                ]
                for r in handoffs
            ],
            left={"case", "pace"},
        ),
        table(
            f"wait() with data there, best of {args.repeats} runs of {args.calls}",
            ["case", "rings", "ns/wait", "ns/has_data"],
            [
                [
                    r["case"],
                    str(r["rings"]),
                    f"{r['ns_per_wait']:.0f}",
                    f"{r['ns_per_has_data']:.0f}",
                ]
                for r in hits
            ],
            left={"case"},
        ),
    )
    write_json(
        {
            "benchmark": "ring",
            "created": now_iso(),
            **environment({"loadavg_at_end": [round(x, 2) for x in os.getloadavg()]}),
            "config": {
                "spin_us": args.spin_us,
                "recheck_ms": args.recheck_ms,
                "pace_s": PACES,
                "ring_bytes": RING_BYTES,
            },
            "handoff": handoffs,
            "hit": hits,
        },
        args.json,
        announce=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
