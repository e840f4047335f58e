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
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from bench.lib.report import write_json
from bench.load.cli import add_output_arguments
from bench.soak.clients import Soak
from bench.soak.growth import default_warmup_s
from bench.soak.report import build_report, plot_report, print_report
from bench.soak.results import EXPECTED, SETTLE_S
from common.memory_probe import ENV as PROBE_ENV
from common.memory_probe import EVERY_ENV as PROBE_EVERY_ENV


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
        from bench.load.servers import ServerProcess, orpheus_serve_argv
        from testkit.local_server import free_port

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
