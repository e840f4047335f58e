"""``orpheus_gateway_saturation``: the node's active streams over what its ready engines can
hold, 0..1, the ratio an inference gateway's endpoint picker reads as a replica's "KV cache
utilisation" (deploy/kubernetes/components/inference-gateway).

Node-wide: two ``Admission``s on one admission segment (as two gateway processes) report the
same ratio; a not-ready engine shrinks the capacity; no ready engine reads 1. Through
``GET /metrics`` of a gateway with the synthetic backend: the scrape carries the ratio of the
streams open at that moment, and 0 once they finish.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator

import aiohttp
import pytest
from gateway_harness import NO_STORE, running_gateway, wait_until
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission.queue import Admission
from shm.admission import AdmissionBoard
from shm.config import ShmConfig
from shm.layout import InstanceLayout
from shm.ring import SHM_DIR
from shm.segments import create_instance, destroy_instance

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def node(layout: InstanceLayout) -> Iterator[InstanceLayout]:
    """An instance of two gateway processes' admission segment."""
    lay = InstanceLayout(instance=layout.instance, run_dir=layout.run_dir, gateways=2)
    create_instance(lay, ShmConfig(code_ring_bytes=64 << 10, pcm_ring_bytes=1 << 20))
    yield lay
    destroy_instance(lay)
    assert not os.path.exists(os.path.join(SHM_DIR, lay.admission_segment))


def gateway_admission(lay: InstanceLayout, index: int, ready: list[bool]) -> Admission:
    return Admission(
        4,
        4,
        5.0,
        1,
        gate=lambda: None,
        board=AdmissionBoard(lay.admission_segment, lay.gateways, index),
        engines=len(ready),
        ready_engines=lambda: tuple(ready),
    )


async def test_saturation_is_the_nodes_streams_over_the_ready_engines_capacity(
    node: InstanceLayout,
) -> None:
    ready = [True, True]  # two engines of 2 slots each (max_active 4)
    a, b = gateway_admission(node, 0, ready), gateway_admission(node, 1, ready)
    try:
        assert a.saturation() == b.saturation() == 0.0
        held = [await a.acquire(), await b.acquire(), await b.acquire()]
        assert a.saturation() == b.saturation() == 0.75, "either process reports the node"
        ready[1] = False  # engine 1 restarts: the node holds 2 now, and 3 streams are open
        assert a.saturation() == b.saturation() == 1.0, "clamped to 1, never above"
        a.release(held[0])
        b.release(held[1])
        b.release(held[2])
        assert a.saturation() == 0.0
        ready[0] = False  # nothing ready: nothing can be taken
        assert a.saturation() == b.saturation() == 1.0
    finally:
        a.close()
        b.close()


def scraped(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} is not in the exposition")


async def test_metrics_scrape_carries_the_saturation_of_the_open_streams(
    layout: InstanceLayout,
) -> None:
    backend = {"realtime": True, "first_chunk_delay_s": 0.2}
    body = {"model": "orpheus", "input": "Hello there. " * 3, "voice": "tara"}
    async with (
        running_gateway(layout, backend=backend, max_active_streams=4) as h,
        aiohttp.ClientSession() as s,
    ):

        async def scrape() -> str:
            async with s.get(f"{h.url}/metrics") as r:
                assert r.status == 200
                return await r.text()

        assert scraped(await scrape(), "orpheus_gateway_saturation") == 0.0
        streams = [
            asyncio.create_task(s.post(f"{h.url}/v1/audio/speech", json=body, headers=NO_STORE))
            for _ in range(3)
        ]
        await wait_until(lambda: len(h.backend.submitted()) == 3, what="three streams open")
        text = await scrape()
        assert scraped(text, "orpheus_gateway_saturation") == 0.75
        assert scraped(text, "orpheus_gateway_active_streams") == 3
        for r in await asyncio.gather(*streams):
            assert r.status == 200
            await r.read()
        assert scraped(await scrape(), "orpheus_gateway_saturation") == 0.0
