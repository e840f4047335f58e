"""``orpheus-serve bench gateway [--json FILE]``: one gateway process under 100 to 1000
concurrent real-time streams, fed by a synthetic PCM source.

Processes: the synthetic source (``testkit.synthetic_backend``, playing the llm_worker and
codec_worker: it reads ``LlmSubmit`` from the control socket and writes real-time-paced,
time-stamped PCM records into the real ring), the gateway (``gateway.main.run``, exactly as
served), and client processes (``testkit.http_client``) holding N streaming HTTP
requests on loopback in a closed loop. Per level it reports the delivery lag of every
chunk (ring write -> last byte at the client; p50/p90/p99/max) and the gateway's CPU time
per second of streamed audio, measured from /proc over a window after the ramp. The gateway
runs on a core of its own (``--gateway-cores``), the source and the clients on the others,
and the hypervisor's steal time over the window is reported next to the lag.
Bounded: each level runs ramp + warm-up + ``--duration`` seconds, then stops.

``--tracing off,on`` measures the cost of OpenTelemetry tracing side by side: the whole run
(a fresh source and gateway, every level) once per mode, in the order given (``off,on,off``
shows the machine's drift); ``on`` exports every request's spans with the real OTLP/HTTP
exporter to a loopback receiver that counts and drops them (``testkit.otlp_receiver``,
in this process, on the load generator's cores); ``off`` sets ``OTEL_SDK_DISABLED``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from bench.gateway.synthetic import SyntheticGateway
from bench.lib.report import environment, show, table, write_json
from bench.lib.stats import percentile
from common.config import ServeConfig
from common.config.gateway import GatewayConfig
from common.config.llm import LLMConfig
from shm.config import ShmConfig
from shm.records import SAMPLE_RATE
from testkit.http_client import CHUNK_BYTES, LevelResult, LevelSpec, client_main

TARGET_P99_LAG_MS = 20.0
BYTES_PER_AUDIO_S = SAMPLE_RATE * 2


def _tokens(audio_seconds: float) -> int:
    """``max_tokens`` of a request for this much synthetic audio (7 tokens a 2048-sample frame)."""
    return 7 * max(1, round(audio_seconds * SAMPLE_RATE / 2048))


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _active_streams(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return int(json.load(r)["active_streams"])
    except urllib.error.HTTPError as e:  # 503 while busy still carries the body
        return int(json.load(e)["active_streams"])


def header() -> dict[str, dict[str, Any]]:
    """The machine (with its load average now) and versions, with those of the gateway's
    network stack; shared with ``bench protocols``."""
    import aiohttp
    import uvloop
    import zmq

    return environment(
        {"loadavg_before": os.getloadavg()},
        {"aiohttp": aiohttp.__version__, "uvloop": uvloop.__version__, "pyzmq": zmq.__version__},
    )


def _steal_ticks() -> dict[int, tuple[int, int]]:
    """Per CPU: (all ticks, steal ticks) from /proc/stat. Steal is time the hypervisor gave
    this virtual CPU to someone else: the process that had it simply stood still."""
    out: dict[int, tuple[int, int]] = {}
    with open("/proc/stat") as f:
        for line in f:
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                ticks = [int(x) for x in fields]
                out[int(name[3:])] = (sum(ticks[:8]), ticks[7] if len(ticks) > 7 else 0)
    return out


def _steal_pct(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], cores: set[int] | None
) -> float:
    cpus = sorted(cores) if cores else sorted(after)
    total = sum(after[c][0] - before[c][0] for c in cpus if c in before)
    steal = sum(after[c][1] - before[c][1] for c in cpus if c in before)
    return round(100 * steal / total, 1) if total else 0.0


def _pin(pid: int, cores: set[int] | None) -> None:
    """Restrict ``pid``'s main thread (the event loop) to ``cores`` (None: leave it be).
    Threads the process started already (ZeroMQ's I/O thread) keep their affinity."""
    if cores:
        os.sched_setaffinity(pid, cores)


def _split_cores(gateway_cores: int) -> tuple[set[int] | None, set[int] | None]:
    """The gateway's cores and everyone else's: the gateway gets ``gateway_cores`` of its own,
    as in production, where the load generator does not share its core."""
    cores = sorted(os.sched_getaffinity(0))
    if gateway_cores <= 0 or gateway_cores >= len(cores):
        return None, None
    return set(cores[-gateway_cores:]), set(cores[:-gateway_cores])


def _run_level(
    ctx: mp.context.SpawnContext,
    port: int,
    streams: int,
    procs: int,
    args: argparse.Namespace,
    gw_pid: int,
    src_pid: int,
    gateway_cores: set[int] | None,
    others_cores: set[int] | None,
) -> dict[str, Any]:
    body = json.dumps({
        "model": "tts-1", "input": "bench", "voice": "tara", "response_format": "pcm",
        "max_tokens": _tokens(args.audio_seconds),
    }).encode()  # fmt: skip
    pipes: list[Connection] = []
    clients = []
    for _ in range(procs):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=client_main, args=(child,), daemon=True)
        p.start()
        assert p.pid is not None
        _pin(p.pid, others_cores)
        pipes.append(parent)
        clients.append(p)
    for c in pipes:
        if not c.poll(60):
            raise RuntimeError("a client process did not start")
        c.recv_bytes()
    now = time.monotonic_ns()
    start = now + 200_000_000
    measure_from = start + int((args.ramp + args.warmup) * 1e9)
    end = measure_from + int(args.duration * 1e9)
    shares = [streams // procs + (1 if i < streams % procs else 0) for i in range(procs)]
    for c, n in zip(pipes, shares, strict=True):
        spec = LevelSpec(port, n, body, start, args.ramp, measure_from, end)
        c.send_bytes(msgspec.msgpack.encode(spec))
    time.sleep(max(0.0, (measure_from - time.monotonic_ns()) / 1e9))
    t0 = time.monotonic()
    gw0, src0 = _cpu_s(gw_pid), _cpu_s(src_pid)
    cl0 = sum(_cpu_s(p.pid) for p in clients if p.pid)
    steal0 = _steal_ticks()
    time.sleep(max(0.0, (end - time.monotonic_ns()) / 1e9))
    steal1 = _steal_ticks()
    window = time.monotonic() - t0
    gw_cpu, src_cpu = _cpu_s(gw_pid) - gw0, _cpu_s(src_pid) - src0
    cl_cpu = sum(_cpu_s(p.pid) for p in clients if p.pid) - cl0
    results = []
    for c in pipes:
        if not c.poll(30):
            raise RuntimeError("a client process did not report")
        results.append(msgspec.msgpack.decode(c.recv_bytes(), type=LevelResult))
    for p in clients:
        p.join(10)
    deadline = time.monotonic() + 15
    while _active_streams(port) and time.monotonic() < deadline:
        time.sleep(0.1)  # abandoned streams are being cancelled
    lags = np.concatenate([np.asarray(r.lags_us, dtype=np.float64) for r in results]) / 1000
    ttfb = np.concatenate([np.asarray(r.ttfb_ms, dtype=np.float64) for r in results])
    audio_s = sum(r.audio_bytes for r in results) / BYTES_PER_AUDIO_S
    chunks = sum(r.chunks for r in results)
    lag_list, ttfb_list = lags.tolist(), ttfb.tolist()
    p99 = percentile(lag_list, 99)
    return {
        "streams": streams,
        "window_s": round(window, 3),
        "chunks": chunks,
        "audio_s_per_s": round(audio_s / window, 2),
        "p50_lag_ms": round(percentile(lag_list, 50), 3),
        "p90_lag_ms": round(percentile(lag_list, 90), 3),
        "p99_lag_ms": round(p99, 3),
        "max_lag_ms": round(float(lags.max()) if lags.size else float("nan"), 3),
        "cpu_ms_per_stream_s": round(1000 * gw_cpu / audio_s, 4) if audio_s else None,
        "gateway_cpu_pct": round(100 * gw_cpu / window, 1),
        "source_cpu_pct": round(100 * src_cpu / window, 1),
        "clients_cpu_pct": round(100 * cl_cpu / window, 1),
        "steal_pct_gateway_cores": _steal_pct(steal0, steal1, gateway_cores),
        "steal_pct_all_cores": _steal_pct(steal0, steal1, None),
        "ttfb_p50_ms": round(percentile(ttfb_list, 50), 2),
        "ttfb_p99_ms": round(percentile(ttfb_list, 99), 2),
        "requests_completed": sum(r.requests for r in results),
        "errors": sum(r.errors for r in results),
        "error_samples": [e for r in results for e in r.error_samples][:5],
        "delivered_ratio": round(audio_s / window / streams, 3),
        "projected_streams_per_core": round(1000 * audio_s / (1000 * gw_cpu)) if gw_cpu else None,
        "meets_target": bool(p99 < TARGET_P99_LAG_MS and all(r.errors == 0 for r in results)),
    }


def _print_table(levels: list[dict[str, Any]]) -> None:
    columns = ("streams", "audio s/s", "p50 lag ms", "p99 lag ms", "max lag ms",
               "gw CPU ms / stream-s", "gw CPU %", "source %", "clients %", "steal %", "errors",
               f"p99 < {TARGET_P99_LAG_MS:g} ms")  # fmt: skip
    rows = [
        (
            str(lv["streams"]), f"{lv['audio_s_per_s']:.0f}", f"{lv['p50_lag_ms']:.2f}",
            f"{lv['p99_lag_ms']:.2f}", f"{lv['max_lag_ms']:.1f}",
            f"{lv['cpu_ms_per_stream_s']:.3f}" if lv["cpu_ms_per_stream_s"] is not None else "-",
            f"{lv['gateway_cpu_pct']:.0f}", f"{lv['source_cpu_pct']:.0f}",
            f"{lv['clients_cpu_pct']:.0f}", f"{lv['steal_pct_gateway_cores']:.1f}",
            str(lv["errors"]),
            "yes" if lv["meets_target"] else "NO",
        )
        for lv in levels
    ]  # fmt: skip
    title = "bench gateway: one gateway process, synthetic real-time PCM, loopback HTTP"
    show(table(title, columns, rows), min_width=132)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="orpheus-serve bench gateway", description=__doc__)
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON")
    ap.add_argument("--levels", default="100,500,1000", help="concurrent streams per level")
    ap.add_argument("--duration", type=float, default=10.0, help="measured seconds per level")
    ap.add_argument("--ramp", type=float, default=2.0, help="seconds over which streams start")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds after the ramp, unmeasured")
    ap.add_argument("--audio-seconds", type=float, default=5.0, help="audio per request")
    ap.add_argument("--client-procs", type=int, default=2, help="client processes")
    ap.add_argument(
        "--gateway-cores", type=int, default=1,
        help="cores reserved for the gateway process, the source and clients run on the others "
        "(0: no pinning; ignored when the machine has too few cores)",
    )  # fmt: skip
    ap.add_argument(
        "--tracing", default="off",
        help="OpenTelemetry tracing modes to run in turn, side by side: off, on, or a list "
        "(off,on): on exports every request's spans to a loopback OTLP receiver",
    )  # fmt: skip
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",") if x.strip()]
    modes = [m.strip() for m in args.tracing.split(",") if m.strip()]
    if not modes or set(modes) - {"off", "on"}:
        ap.error(f"--tracing: off, on or a list of them, not {args.tracing!r}")

    ctx = mp.get_context("spawn")
    env = header()
    machine = env["machine"]
    results: list[dict[str, Any]] = []
    receiver = None
    sdk_disabled = os.environ.get("OTEL_SDK_DISABLED")  # _run_mode sets it; restored below
    if "on" in modes:
        from testkit.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver(keep=False)
    try:
        for mode in modes:
            print(f"tracing {mode} ...", file=sys.stderr, flush=True)
            endpoint = f"{receiver.url}/v1/traces" if receiver is not None and mode == "on" else ""
            spans_before = receiver.span_count if receiver is not None else 0
            runs = _run_mode(ctx, args, levels, endpoint, machine)
            time.sleep(0.5 if receiver is None else 1.0)  # the exporter's last batch
            spans = (receiver.span_count - spans_before) if receiver is not None else 0
            for lv in runs:
                lv["tracing"] = mode
                lv["spans_exported_per_mode"] = spans
            results.extend(runs)
    finally:
        if receiver is not None:
            receiver.close()
        if sdk_disabled is None:
            os.environ.pop("OTEL_SDK_DISABLED", None)
        else:
            os.environ["OTEL_SDK_DISABLED"] = sdk_disabled

    machine["loadavg_after"] = os.getloadavg()
    _print_table(results)
    report = {
        "benchmark": "gateway",
        "description": "one gateway process; synthetic real-time PCM (85.3 ms chunks of 4096 B) "
        "into the real ring; N closed-loop streaming HTTP clients (pcm) on loopback in "
        f"{args.client_procs} client processes; lag = ring write -> last byte at the client",
        **env,
        "config": {
            "levels": levels,
            "duration_s": args.duration,
            "ramp_s": args.ramp,
            "warmup_s": args.warmup,
            "audio_seconds_per_request": args.audio_seconds,
            "client_procs": args.client_procs,
            "gateway_cores": args.gateway_cores,
            "chunk_bytes": CHUNK_BYTES,
            "tracing": modes,
        },
        "target": {"streams": 1000, "p99_lag_ms": TARGET_P99_LAG_MS},
        "notes": [
            "delivered_ratio < 1: the clients got less audio than real time, i.e. some process "
            "of the run (gateway, source or clients) did not get the CPU it needed",
            "projected_streams_per_core = 1 / (gateway CPU seconds per stream-second): how many "
            "real-time streams one dedicated core could carry at the measured cost",
            "steal_pct_*: share of the window the hypervisor took the (virtual) cores away; on a "
            "VM it comes in bursts of tens of ms that stall the event loop and show up as lag",
            "tracing on: every request is a trace (the default sampler), its spans exported "
            "over OTLP/HTTP to a loopback receiver; spans_exported_per_mode counts them",
        ],
        "levels": results,
    }
    write_json(report, args.json, announce=sys.stderr)
    return 0


def _run_mode(
    ctx: mp.context.SpawnContext,
    args: argparse.Namespace,
    levels: list[int],
    traces_endpoint: str,
    machine: dict[str, Any],
) -> list[dict[str, Any]]:
    """A fresh source and gateway (tracing to ``traces_endpoint``; empty: off), every level."""
    if traces_endpoint:
        os.environ.pop("OTEL_SDK_DISABLED", None)
    else:
        os.environ["OTEL_SDK_DISABLED"] = "true"  # the spawned gateway inherits it

    def configure(shm: ShmConfig, port: int, _run_dir: str) -> ServeConfig:
        return ServeConfig(
            device="cpu", log_level="WARNING", shm=shm,
            # A fixed count: the synthetic backend's pace is set here, not by the load.
            gateway=GatewayConfig(port=port, max_active_streams=max(levels) + 64,
                                  max_queued_streams=1024, playground=False, admission="fixed"),
            # the gateway refuses max_tokens over the cap (common.limits): room for --audio-seconds
            llm=LLMConfig(max_tokens_cap=max(LLMConfig().max_tokens_cap, _tokens(args.audio_seconds))),
            otlp_traces_endpoint=traces_endpoint,
        )  # fmt: skip

    results: list[dict[str, Any]] = []
    # Real-time pacing, batched every 5 ms like the codec worker's decode batches.
    with SyntheticGateway(configure, stamp=True, tick_s=0.005) as served:
        gateway, source = served.gateway, served.source
        assert gateway.pid is not None and source.pid is not None
        gateway_cores, others_cores = _split_cores(args.gateway_cores)
        _pin(gateway.pid, gateway_cores)
        _pin(source.pid, others_cores)
        machine["gateway_cores"] = sorted(gateway_cores) if gateway_cores else "any"
        machine["load_generator_cores"] = sorted(others_cores) if others_cores else "any"
        for n in levels:
            print(f"level {n} streams ...", file=sys.stderr, flush=True)
            results.append(
                _run_level(
                    ctx,
                    served.port,
                    n,
                    args.client_procs,
                    args,
                    gateway.pid,
                    source.pid,
                    gateway_cores,
                    others_cores,
                )
            )
    return results


if __name__ == "__main__":
    sys.exit(main())
