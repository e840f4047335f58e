"""What does a 429 cost the gateway's CPU, with the early refusal and without?

The real gateway process in front of the synthetic backend (``bench.gateway.synthetic``),
fixed admission, one slot, no queue: one long stream holds the slot, then ``--requests``
refused ``POST /v1/audio/speech`` go one after another over fresh connections (as
``bench overload``'s clients send them: the shipped corpus, a fifth of them long paragraphs).
Printed: the gateway process's CPU per refusal (``/proc``) and this client's, per arm, the
arms alternated ``--rounds`` times::

    PYTHONPATH=. python scripts/dev/refusal_cpu.py --requests 1000 --rounds 3

docs/performance.md, "The refusals' CPU and early refusals" (issue 60).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import time

import aiohttp

from bench.load.texts import load_corpus
from bench.gateway.synthetic import SyntheticGateway
from common.config import ServeConfig
from common.config.gateway import GatewayConfig
from shm.config import ShmConfig

KEY = "refusal-cpu"


def process_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def refuse(url: str, pid: int, n: int) -> tuple[float, float, dict[int, int]]:
    """(gateway CPU s, client CPU s, statuses) over ``n`` requests while one holds the slot."""
    corpus = load_corpus()
    texts = [*corpus.short[:40], *corpus.long[:10]]
    headers = {"Authorization": f"Bearer {KEY}"}
    speech = url + "/v1/audio/speech"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s:
        hold_body = {"model": "tts-1", "input": "hold " * 50, "voice": "tara", "max_tokens": 3500}
        hold = await s.post(speech, json=hold_body, headers=headers)
        assert hold.status == 200, hold.status
        await hold.content.read(1000)
        statuses: dict[int, int] = {}
        gateway0, client0 = process_cpu_s(pid), own_cpu_s()
        for i in range(n):
            body = {
                "model": "tts-1", "input": texts[i % len(texts)], "voice": "tara",
                "response_format": "pcm", "stream_format": "audio", "speed": 1.0,
            }  # fmt: skip
            async with s.post(speech, json=body, headers=headers) as r:
                await r.read()
                statuses[r.status] = statuses.get(r.status, 0) + 1
        gateway1, client1 = process_cpu_s(pid), own_cpu_s()
        hold.close()
    return gateway1 - gateway0, client1 - client0, statuses


def arm(early: bool, n: int) -> str:
    def configure(shm: ShmConfig, port: int, _run_dir: str) -> ServeConfig:
        return ServeConfig(
            device="cpu", log_level="INFO", shm=shm,
            gateway=GatewayConfig(
                port=port, max_active_streams=1, max_queued_streams=0, playground=False,
                admission="fixed", api_keys=[KEY], early_refusal=early,
            ),
        )  # fmt: skip

    with SyntheticGateway(configure, tick_s=0.005) as gw:
        gateway_s, client_s, statuses = asyncio.run(refuse(gw.url, gw.gateway.pid, n))
    return (
        f"early_refusal={str(early).lower():5} {statuses}: gateway {1e3 * gateway_s / n:.2f} ms "
        f"CPU a refusal, client {1e3 * client_s / n:.2f} ms"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    for _ in range(args.rounds):
        for early in (False, True):
            print(arm(early, args.requests), f"(load {os.getloadavg()[0]:.1f})", flush=True)
            time.sleep(0.5)


if __name__ == "__main__":
    main()
