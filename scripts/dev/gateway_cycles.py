"""Which reference cycles does the gateway leave behind its requests, and through what?

The soak's own clients (``bench.soak.clients.Soak``: complete, disconnecting, WebSocket barge-in,
slow reader, bad requests, floods past admission) run for ``--duration`` seconds against the
gateway of ``tests/harness/gateway_harness.py`` (the real gateway and the synthetic backend in this
process, on uvloop as served) while the collector keeps everything it finds unreachable
(``gc.DEBUG_SAVEALL``). Then: the garbage by type, and for each type asked for
(``--trace``) one cycle through it, link by link (the attribute or key of each reference)::

    PYTHONPATH=. python scripts/dev/gateway_cycles.py --duration 20

``tests/gateway/test_cycles.py`` is the check that the project's code leaves none; this is
how to find where one comes from (docs/performance.md, "Memory over hours").
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from collections import Counter, deque
from pathlib import Path
from types import FrameType
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "harness"))
from gateway_harness import garbage_of, running_gateway

from bench.soak.cli import build_parser
from bench.soak.clients import Soak
from shm.layout import InstanceLayout
from shm.segments import destroy_instance

DEFAULT_TRACE = "ActiveRequest,ClientLink,RequestHandler,traceback"


def cycle_through(start: Any, among: set[int]) -> list[Any] | None:
    """The shortest cycle from ``start`` back to it through objects whose ids are ``among``."""
    prev: dict[int, int | None] = {id(start): None}
    objs = {id(start): start}
    queue = deque([start])
    while queue:
        o = queue.popleft()
        for r in gc.get_referents(o):
            if r is start:
                path, k = [o], id(o)
                while (p := prev[k]) is not None:
                    path.append(objs[p])
                    k = p
                return path[::-1]
            if id(r) in among and id(r) not in prev:
                prev[id(r)] = id(o)
                objs[id(r)] = r
                queue.append(r)
    return None


def link(a: Any, b: Any) -> str:
    """How ``a`` refers to ``b``: ``.attr``, ``[key]`` or ``->``."""
    if isinstance(a, dict):
        for k, v in a.items():
            if v is b:
                return f"[{k!r}]"
    for name in getattr(type(a), "__slots__", ()) or ():
        if getattr(a, name, None) is b:
            return f".{name}"
    if getattr(a, "__dict__", None) is b:
        return ".__dict__"
    return "->"


def label(o: Any) -> str:
    name = type(o).__qualname__
    return f"{name}({o.f_code.co_name})" if isinstance(o, FrameType) else name


async def drive(args: argparse.Namespace) -> list[Any]:
    run_dir = tempfile.mkdtemp(prefix="orpheus-cycles-")
    layout = InstanceLayout(instance=f"orpheus-{os.getpid()}-cycles", run_dir=run_dir)
    os.makedirs(layout.socket_dir)
    try:
        async with running_gateway(
            layout, backend={"realtime": True}, max_active_streams=16, max_queued_streams=8
        ) as h:
            argv = ["--url", h.url, "--pid", "1", "--duration", str(args.duration),
                    "--flood-size", "40", "--flood-every", "5"]  # fmt: skip
            soak = Soak(build_parser().parse_args(argv), h.url, "orpheus-1")
            garbage = await garbage_of(soak.traffic, settle_s=1.0)
            outcomes = Counter((s.scenario, s.outcome) for s in soak.streams)
            print(f"{len(soak.streams)} requests: " + ", ".join(
                f"{sc} {oc} {n}" for (sc, oc), n in sorted(outcomes.items())))  # fmt: skip
            return garbage
    finally:
        destroy_instance(layout)
        shutil.rmtree(run_dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of the soak's mix")
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="types to show a cycle through")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    garbage = uvloop.run(drive(args))
    print(f"unreachable objects: {len(garbage)}")
    for name, n in Counter(type(o).__qualname__ for o in garbage).most_common(args.top):
        print(f"  {n:6d}  {name}")
    among = {id(o) for o in garbage}
    for name in args.trace.split(","):
        first = next((o for o in garbage if type(o).__qualname__ == name), None)
        cycle = cycle_through(first, among) if first is not None else None
        if cycle is None:
            print(f"{name}: in no cycle of the garbage")
            continue
        text = label(cycle[0])
        for a, b in zip(cycle, [*cycle[1:], cycle[0]], strict=True):
            text += f" {link(a, b)} {label(b)}"
        print(f"{name}: {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
