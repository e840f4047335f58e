"""The gateway's code leaves no reference cycles behind a request (issue 36).

A serving process collects its older generations rarely (``common.heap.settle``), so a cycle
per request is memory held until a full collection: it was the soak's gateway's +2 MB/h. The
soak's own clients (``bench.soak``: complete, disconnecting, WebSocket barge-in, slow
reader, bad requests, floods past admission) run against the gateway with its synthetic
backend while the collector keeps everything it finds unreachable (``DEBUG_SAVEALL``); then
nothing of it may be an exception, a frame, or an object of the project's code. What aiohttp
itself leaves is counted and allowed: every WebSocket connection (its ``RequestHandler`` keeps
the response's ``_on_data_received`` after ``connection_lost``; ``settle``'s clock-driven full
collection bounds it).
"""

from __future__ import annotations

from collections import Counter
from types import FrameType, TracebackType

import pytest
from gateway_harness import garbage_of, running_gateway

from bench.soak.cli import build_parser
from bench.soak.clients import Soak
from shm.layout import InstanceLayout

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

PROJECT = ("gateway", "common", "store", "shm", "orpheus_wire", "llm_worker", "codec_worker")


async def test_the_soak_mix_leaves_no_cycle_of_ours(layout: InstanceLayout) -> None:
    async with running_gateway(
        layout, backend={"realtime": True}, max_active_streams=8, max_queued_streams=4
    ) as h:
        argv = ["--url", h.url, "--pid", "1", "--duration", "10", "--users", "4",
                "--flood-size", "24", "--flood-every", "2", "--max-frames", "16"]  # fmt: skip
        soak = Soak(build_parser().parse_args(argv), h.url, "orpheus-1")
        garbage = await garbage_of(soak.traffic, settle_s=0.5)
    outcomes = Counter((s.scenario, s.outcome) for s in soak.streams)
    for needed in [("complete", "ok"), ("disconnect", "disconnected"), ("ws_cancel", "cancelled"),
                   ("bad_request", "rejected"), ("flood", "refused")]:  # fmt: skip
        assert outcomes[needed] > 0, (needed, outcomes)
    ours = Counter(
        type(o).__qualname__
        for o in garbage
        if isinstance(o, BaseException | FrameType | TracebackType)
        or type(o).__module__.split(".")[0] in PROJECT
    )
    del garbage
    assert not ours, f"cycles of the project's code after {len(soak.streams)} requests: {ours}"
