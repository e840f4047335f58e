#!/usr/bin/env python3
"""Small tools for the GPU recipe (scripts/gpu/run_capacity.sh). Standard library only,
except where a subcommand says (torch for ``facts --ceilings``, psutil for ``procs``).

    gpu_tools.py facts [--ceilings] [--json F]   machine, versions, GPU; matmul/copy ceilings
    gpu_tools.py procs --out F [--interval S]    sample per-process CPU (until killed)
    gpu_tools.py procs-summary F                 mean/max CPU per role from those samples
    gpu_tools.py trace-summary TRACE... [--json F]
        GPU busy time and the idle gaps between kernels, top kernels, top CPU ranges, from
        torch profiler traces (Chrome JSON, .gz or not): what bounds an engine step
    gpu_tools.py capacity REPORT [--budget 1.0]  the concurrency `bench load --search` found
    gpu_tools.py stamp FILE... --commit SHA      fill versions.git_commit where it is null
    gpu_tools.py pack SRC OUT --name NAME [--max-files N] [--max-mib M]
        SRC's files into OUT/NAME.tgz, split into 15 MiB pieces (the device returns at most
        8 files of 16 MiB, 64 MiB in all, per call)
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from pathlib import Path

MIB = 1 << 20


# ----------------------------------------------------------------------------- facts


def _run(*cmd: str) -> str | None:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout.strip() if p.returncode == 0 else None


def _ceilings() -> dict:
    """METHOD.md's two ceilings, measured: a bf16 8192^3 matmul on random data (mean of 10
    after 3 warm-ups) and a large device-to-device copy (bytes read + written)."""
    import torch

    dev = torch.device("cuda")
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize()
    mm_ms = start.elapsed_time(end) / 10
    x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)  # 1 GiB
    x.random_(0, 255)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    torch.cuda.synchronize()
    cp_ms = start.elapsed_time(end) / 10
    del a, b, x, y
    torch.cuda.empty_cache()
    return {
        "bf16_matmul_8192_tflops": round(2 * n**3 / (mm_ms / 1e3) / 1e12, 1),
        "d2d_copy_tb_s": round(2 * (1 << 30) / (cp_ms / 1e3) / 1e12, 2),
    }


def cmd_facts(args: argparse.Namespace) -> int:
    from importlib import metadata

    facts: dict = {"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    q = _run(
        "nvidia-smi",
        "--query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem,power.limit",
        "--format=csv,noheader",
    )
    facts["nvidia_smi"] = q
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    facts["cpu"] = cpu
    facts["cores"] = len(os.sched_getaffinity(0))
    facts["python"] = sys.version.split()[0]
    vers = {}
    for d in ("torch", "vllm", "triton", "transformers", "tokenizers", "snac", "numpy",
              "orpheus-serve", "aiohttp", "uvloop", "pyzmq", "msgspec", "av"):  # fmt: skip
        try:
            vers[d] = metadata.version(d)
        except metadata.PackageNotFoundError:
            vers[d] = None
    facts["versions"] = vers
    facts["git_commit"] = os.environ.get("GIT_COMMIT") or None
    if args.ceilings:
        try:
            facts["ceilings"] = _ceilings()
        except Exception as e:  # a fact, not a failure of the recipe
            facts["ceilings"] = {"error": f"{type(e).__name__}: {e}"}
    text = json.dumps(facts, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


# ----------------------------------------------------------------------------- processes

ROLES = (
    ("EngineCore", "engine_core"),
    ("orchestrator.child llm", "llm_worker"),
    ("orpheus-serve llm", "llm_worker"),
    ("orchestrator.child codec", "codec_worker"),
    ("orpheus-serve codec", "codec_worker"),
    ("orchestrator.child gateway", "gateway"),
    ("orpheus-serve gateway", "gateway"),
    ("bench load", "bench"),
    ("bench compare", "bench"),
    ("bench.load", "bench"),
    ("orpheus_serve.cli serve", "orchestrator"),
    ("orpheus-serve serve", "orchestrator"),
    ("spawn_main", "mp_child"),  # vLLM's engine core before setproctitle renames it
)


def _role(cmdline: str) -> str | None:
    for needle, role in ROLES:
        if needle in cmdline:
            return role
    return None


def cmd_procs(args: argparse.Namespace) -> int:
    """JSON lines: {"t": time, "p": [[pid, role, cpu_percent, rss_mib, threads], ...]}."""
    import psutil

    tracked: dict[int, tuple[psutil.Process, str]] = {}
    with open(args.out, "a") as f:
        while True:
            for p in psutil.process_iter(["pid", "cmdline"]):
                if p.pid in tracked:
                    continue
                role = _role(" ".join(p.info["cmdline"] or []))
                if role:
                    try:
                        p.cpu_percent(None)  # primes the counter
                    except psutil.Error:
                        continue
                    tracked[p.pid] = (p, role)
            row = []
            for pid, (p, role) in list(tracked.items()):
                try:
                    with p.oneshot():
                        row.append([pid, role, p.cpu_percent(None), p.memory_info().rss / MIB,
                                    p.num_threads()])  # fmt: skip
                except psutil.Error:
                    del tracked[pid]
            f.write(json.dumps({"t": round(time.time(), 2), "p": row}) + "\n")
            f.flush()
            time.sleep(args.interval)


def cmd_procs_summary(args: argparse.Namespace) -> int:
    per: dict[str, list[float]] = defaultdict(list)
    for line in Path(args.file).read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        by_role: dict[str, float] = defaultdict(float)
        for _pid, role, cpu, _rss, _thr in rec["p"]:
            by_role[role] += cpu
        for role, cpu in by_role.items():
            per[role].append(cpu)
    out = {
        role: {
            "samples": len(v),
            "cpu_mean_pct": round(sum(v) / len(v), 1),
            "cpu_max_pct": round(max(v), 1),
        }
        for role, v in sorted(per.items())
        if v
    }
    print(json.dumps(out, indent=1))
    return 0


# ----------------------------------------------------------------------------- traces


def _load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _union(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Total covered time and the gaps between covered stretches (microseconds)."""
    busy = 0.0
    gaps: list[float] = []
    end = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                gaps.append(s - end)
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy, gaps


def summarize_trace(path: Path, top: int = 15, step_re: str | None = None) -> dict:
    events = [e for e in _load_trace(path) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [e for e in gpu if e.get("cat") == "kernel"]
    cpu_ranges = [e for e in events if e.get("cat") in ("user_annotation", "gpu_user_annotation")
                  and not str(e.get("name", "")).startswith("ProfilerStep")]  # fmt: skip
    ops = [e for e in events if e.get("cat") in ("cpu_op", "python_function")]
    out: dict = {"trace": path.name, "events": len(events)}
    t0 = min((e["ts"] for e in events), default=0.0)
    t1 = max((e["ts"] + e["dur"] for e in events), default=0.0)
    out["window_ms"] = round((t1 - t0) / 1e3, 2)
    if gpu:
        g0 = min(e["ts"] for e in gpu)
        g1 = max(e["ts"] + e["dur"] for e in gpu)
        busy, gaps = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
        span = g1 - g0
        out["gpu"] = {
            "span_ms": round(span / 1e3, 2),
            "busy_ms": round(busy / 1e3, 2),
            "busy_fraction": round(busy / span, 4) if span else None,
            "kernels": len(kernels),
            "idle_gaps": {
                "count_over_20us": sum(g > 20 for g in gaps),
                "ms_in_gaps_over_20us": round(sum(g for g in gaps if g > 20) / 1e3, 2),
                "count_over_1ms": sum(g > 1000 for g in gaps),
                "ms_in_gaps_over_1ms": round(sum(g for g in gaps if g > 1000) / 1e3, 2),
                "largest_ms": round(max(gaps, default=0.0) / 1e3, 3),
            },
        }
        by_kernel: dict[str, list[float]] = defaultdict(list)
        for e in kernels:
            by_kernel[str(e.get("name"))[:120]].append(e["dur"])
        out["top_kernels"] = [
            {
                "name": n,
                "count": len(d),
                "total_ms": round(sum(d) / 1e3, 2),
                "mean_us": round(sum(d) / len(d), 1),
            }
            for n, d in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))[:top]
        ]
    by_range: dict[str, list[float]] = defaultdict(list)
    for e in cpu_ranges:
        by_range[str(e.get("name"))[:120]].append(e["dur"])
    out["top_ranges"] = [
        {
            "name": n,
            "count": len(d),
            "total_ms": round(sum(d) / 1e3, 2),
            "mean_ms": round(sum(d) / len(d) / 1e3, 3),
            "max_ms": round(max(d) / 1e3, 3),
        }
        for n, d in sorted(by_range.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]
    by_op: dict[str, list[float]] = defaultdict(list)
    for e in ops:
        by_op[str(e.get("name"))[:120]].append(e["dur"])
    out["top_cpu_ops"] = [
        {"name": n, "count": len(d), "total_ms": round(sum(d) / 1e3, 2)}
        for n, d in sorted(by_op.items(), key=lambda kv: -sum(kv[1]))[:top]
    ]
    if step_re:
        rx = re.compile(step_re)
        steps = sorted((e for e in cpu_ranges if rx.search(str(e.get("name", "")))),
                       key=lambda e: e["ts"])  # fmt: skip
        if steps:
            durs = sorted(e["dur"] for e in steps)
            starts = [e["ts"] for e in steps]
            period = [b - a for a, b in itertools.pairwise(starts)]
            out["steps"] = {
                "pattern": step_re,
                "count": len(steps),
                "p50_ms": round(durs[len(durs) // 2] / 1e3, 3),
                "p90_ms": round(durs[int(len(durs) * 0.9)] / 1e3, 3),
                "mean_period_ms": round(sum(period) / len(period) / 1e3, 3) if period else None,
            }
    return out


def cmd_trace_summary(args: argparse.Namespace) -> int:
    results = []
    for p in args.traces:
        try:
            results.append(summarize_trace(Path(p), args.top, args.steps))
        except Exception as e:  # one bad trace must not hide the others
            results.append({"trace": Path(p).name, "error": f"{type(e).__name__}: {e}"})
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    for r in results:
        g = r.get("gpu") or {}
        print(
            f"{r['trace']}: window {r.get('window_ms')} ms, GPU busy "
            f"{g.get('busy_fraction')} of {g.get('span_ms')} ms, "
            f"{(g.get('idle_gaps') or {}).get('ms_in_gaps_over_20us')} ms in gaps > 20 us"
            + (f", steps p50 {r['steps']['p50_ms']} ms" if "steps" in r else "")
        )
    return 0


# ----------------------------------------------------------------------------- results


def capacity_of(report: dict, budget: float) -> int | None:
    search = report.get("search") or {}
    caps = search.get("capacities") or report.get("capacity") or []
    if isinstance(caps, dict):
        caps = [caps]
    for c in caps:
        if isinstance(c, dict) and abs(float(c.get("ttfb_budget_s", -1)) - budget) < 1e-9:
            return int(c["concurrency"])
    if isinstance(report.get("capacity"), int):
        return report["capacity"]
    return None


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, json.JSONDecodeError):
        return 1
    c = capacity_of(report, args.budget)
    if c is None:
        return 1
    print(c)
    return 0


def cmd_stamp(args: argparse.Namespace) -> int:
    for f in args.files:
        p = Path(f)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        v = data.get("versions") if isinstance(data, dict) else None
        if isinstance(v, dict) and not v.get("git_commit") and args.commit:
            v["git_commit"] = args.commit
            v["git_commit_source"] = "GIT_COMMIT given to scripts/gpu/run_capacity.sh"
            p.write_text(json.dumps(data, indent=2) + "\n")
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    """Archive SRC into OUT/NAME.tgz under --max-mib; when it is larger, leave out the largest
    files one at a time (listed in the archive's PACK_OMITTED.txt) until it fits."""
    src, out = Path(args.src), Path(args.out)
    files = sorted((p for p in src.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    if not files:
        return 0
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{args.name}.tgz"
    omitted: list[str] = []
    while True:
        with tarfile.open(archive, "w:gz") as tar:
            for p in files:
                tar.add(p, arcname=str(p.relative_to(src)))
            if omitted:
                note = src / "PACK_OMITTED.txt"
                note.write_text("left out to fit the size limit:\n" + "\n".join(omitted) + "\n")
                tar.add(note, arcname=note.name)
        size = archive.stat().st_size
        if size <= args.max_mib * MIB or not files:
            break
        dropped = files.pop()  # the largest
        omitted.append(f"{dropped.relative_to(src)} ({dropped.stat().st_size / MIB:.1f} MiB)")
    if omitted:
        print(f"WARNING: {archive.name}: left out {', '.join(omitted)}", file=sys.stderr)
    piece = 15 * MIB
    if size > piece:
        data = archive.read_bytes()
        archive.unlink()
        for i in range(0, len(data), piece):
            (out / f"{args.name}.tgz.{i // piece:02d}").write_bytes(data[i : i + piece])
        print(
            f"{args.name}.tgz: {size / MIB:.1f} MiB in {-(-size // piece)} pieces "
            f"(cat {args.name}.tgz.* > {args.name}.tgz)"
        )
    else:
        print(f"{args.name}.tgz: {size / MIB:.1f} MiB")
    n = sum(1 for p in out.iterdir() if p.is_file())
    if n > args.max_files:
        print(f"WARNING: {n} files in {out}; only {args.max_files} come back", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_tools.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("facts")
    s.add_argument("--ceilings", action="store_true")
    s.add_argument("--json")
    s = sub.add_parser("procs")
    s.add_argument("--out", required=True)
    s.add_argument("--interval", type=float, default=1.0)
    s = sub.add_parser("procs-summary")
    s.add_argument("file")
    s = sub.add_parser("trace-summary")
    s.add_argument("traces", nargs="+")
    s.add_argument("--json")
    s.add_argument("--top", type=int, default=15)
    s.add_argument("--steps", default=None, help="regex of the range that marks one step")
    s = sub.add_parser("capacity")
    s.add_argument("report")
    s.add_argument("--budget", type=float, default=1.0)
    s = sub.add_parser("stamp")
    s.add_argument("files", nargs="+")
    s.add_argument("--commit", default=os.environ.get("GIT_COMMIT"))
    s = sub.add_parser("pack")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--name", required=True)
    s.add_argument("--max-files", type=int, default=8)
    s.add_argument("--max-mib", type=float, default=60.0)
    args = p.parse_args(argv)
    return {
        "facts": cmd_facts,
        "procs": cmd_procs,
        "procs-summary": cmd_procs_summary,
        "trace-summary": cmd_trace_summary,
        "capacity": cmd_capacity,
        "stamp": cmd_stamp,
        "pack": cmd_pack,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
