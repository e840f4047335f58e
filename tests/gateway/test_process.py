"""gateway.main.run as the orchestrator runs it: its own process, SO_REUSEPORT shared by two
gateway processes, WorkerReady/Heartbeat to the orchestrator socket, SIGTERM drain, no torch."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import msgspec
import pytest
import zmq
from gateway_harness import NO_STORE, serve_config, wait_until
from gateway_process import gateway_argv, gateway_env, start_gateway

from orchestrator.proctree import alive
from shm.admission import create_admission_segment
from shm.layout import InstanceLayout
from shm.messages import Heartbeat, WorkerReady, orchestrator_decoder
from shm.ring import create_ring, unlink_ring
from testkit.local_server import free_port, wait_ready
from testkit.synthetic_backend import SyntheticBackend, synthetic_pcm

pytestmark = pytest.mark.timeout(90)

# Another process of the instance writing its metrics (as the llm_worker writes vLLM's).
OTHER_PROCESS_METRIC = """
from prometheus_client import Counter
Counter("vllm:test_requests", "a metric of another process").inc(3)
"""


def pcm_for(frames: int) -> bytes:
    return b"".join(synthetic_pcm(i * 2048, 2048).tobytes() for i in range(frames))


async def test_two_processes_share_the_port_and_drain_on_sigterm(layout: InstanceLayout) -> None:
    lay = InstanceLayout(instance=layout.instance, run_dir=layout.run_dir, gateways=2)
    for i in range(2):
        create_ring(lay.pcm_ring(i), 4 << 20)
    create_admission_segment(lay.admission_segment, 2)  # as the orchestrator does
    port = free_port()
    config = serve_config(port=port, processes=2)
    orch = zmq.Context.instance().socket(zmq.PULL)
    orch.setsockopt(zmq.LINGER, 0)
    orch.bind(lay.orch)
    backend = SyntheticBackend(lay, realtime=True).start()
    metrics_dir = os.path.join(lay.socket_dir, "metrics")
    os.makedirs(metrics_dir)
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    subprocess.run([sys.executable, "-c", OTHER_PROCESS_METRIC], env=env, check=True)
    procs = [start_gateway(config, lay, i, metrics_dir) for i in range(2)]
    try:
        ready: dict[int, WorkerReady] = {}
        beats: set[int] = set()
        deadline = time.monotonic() + 30
        while (len(ready) < 2 or len(beats) < 2) and time.monotonic() < deadline:
            if orch.poll(200):
                msg = orchestrator_decoder.decode(orch.recv())
                if isinstance(msg, WorkerReady):
                    ready[msg.pid] = msg
                elif isinstance(msg, Heartbeat):
                    beats.add(msg.pid)
            for p in procs:
                assert p.poll() is None, p.stderr.read() if p.stderr else ""
        assert set(ready) == {p.pid for p in procs} == beats
        assert {m.role for m in ready.values()} == {"gateway-0", "gateway-1"}

        url = f"http://127.0.0.1:{port}/v1/audio/speech"
        body = {"model": "tts-1", "input": "x", "voice": "alloy", "response_format": "pcm"}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:

            async def one(frames: int) -> bytes:
                # no-store: twins would follow one synthesis, whichever process they reached
                # (single flight across the node), and this counts where they were spoken.
                json = {**body, "max_tokens": 7 * frames}
                async with s.post(url, json=json, headers=NO_STORE) as r:
                    assert r.status == 200, await r.text()
                    return await r.read()

            # Enough connections that the kernel spreads them over both processes.
            results = await asyncio.gather(*(one(3) for _ in range(16)))
            assert all(r == pcm_for(3) for r in results)
            used = {sub.stream_id >> 48 for sub in backend.submitted()}
            assert used == {0, 1}, "both gateway processes served requests"

            # One scrape of either process carries every process's metrics.
            async with s.get(f"http://127.0.0.1:{port}/metrics") as r:
                text = await r.text()
            assert 'orpheus_gateway_requests_total{api="http",outcome="ok"} 16.0' in text
            assert "vllm:test_requests_total 3.0" in text

            # SIGTERM while a stream is active: it finishes, new ones are refused.
            async with s.post(url, json={**body, "max_tokens": 7 * 12}) as r:
                assert r.status == 200
                first = await r.content.readexactly(4096)
                for p in procs:
                    p.send_signal(signal.SIGTERM)
                rest = await r.read()
            assert first + rest == pcm_for(12)
        codes = [p.wait(30) for p in procs]
        assert codes == [0, 0]
        for p in procs:
            out = p.stdout.read() if p.stdout else ""
            assert "torch imported: False" in out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        backend.stop()
        orch.close(linger=0)
        unlink_ring(lay.pcm_ring(1))


async def test_drain_timeout_aborts_streams_and_exits(layout: InstanceLayout) -> None:
    create_ring(layout.pcm_ring(0), 4 << 20)
    port = free_port()
    config = msgspec.structs.replace(serve_config(port=port), drain_timeout_s=0.5)
    backend = SyntheticBackend(layout, realtime=True).start()
    proc = start_gateway(config, layout, 0)
    try:
        async with aiohttp.ClientSession() as s:
            await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}", proc.poll, 30)
            body = {"model": "m", "input": "x", "voice": "tara", "response_format": "pcm",
                    "max_tokens": 7 * 500}  # fmt: skip
            async with s.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body) as r:
                await r.content.readexactly(4096)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
        assert proc.wait(15) == 0
        assert time.monotonic() - t0 < 10
        await wait_until(lambda: len(backend.cancelled_ids()) == 1, what="Cancel on abort")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        backend.stop()


# Starts the command in its argv, prints the child's pid and exits when its stdin closes,
# leaving the child an orphan (as the orchestrator's death leaves its gateways).
PARENT = """
import subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
sys.stdin.read()
"""


async def test_an_orphaned_gateway_stops_at_once_on_sigterm(layout: InstanceLayout) -> None:
    """The SIGTERM a gateway hears once its orchestrator is gone (PR_SET_PDEATHSIG) ends it
    at once: the workers die with the orchestrator, so a stream in flight could not finish
    and a drain (here up to 60 s) would only keep the instance's last process alive."""
    create_ring(layout.pcm_ring(0), 4 << 20)
    port = free_port()
    config = msgspec.structs.replace(serve_config(port=port), drain_timeout_s=60.0)
    backend = SyntheticBackend(layout, realtime=True).start()
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, *gateway_argv(config, layout, 0)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=gateway_env(""),
    )  # fmt: skip
    assert parent.stdout is not None and parent.stdin is not None
    pid = int(parent.stdout.readline())
    try:
        async with aiohttp.ClientSession() as s:
            exited = lambda: None if alive(pid) else -1  # noqa: E731 (not our child: no poll)
            await asyncio.to_thread(wait_ready, f"http://127.0.0.1:{port}", exited, 30)
            body = {"model": "m", "input": "x", "voice": "tara", "response_format": "pcm",
                    "max_tokens": 7 * 500}  # fmt: skip
            async with s.post(f"http://127.0.0.1:{port}/v1/audio/speech", json=body) as r:
                await r.content.readexactly(4096)
                parent.stdin.close()  # the parent exits: the gateway is an orphan now
                assert parent.wait(10) == 0
                t0 = time.monotonic()
                os.kill(pid, signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await r.read()
        await wait_until(lambda: not alive(pid), timeout_s=15, what="the orphan's exit")
        assert time.monotonic() - t0 < 15  # not the 60 s drain
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        backend.stop()
