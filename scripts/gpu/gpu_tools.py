#!/usr/bin/env python3
"""Small tools for the GPU recipe (scripts/gpu/run_capacity.sh). Standard library only,
except where a subcommand says (torch for ``facts --ceilings``, psutil for ``procs``; the
project's ``bench`` package, whose result classes read its results, for ``capacity``,
``predict`` and ``best-engines``).

    gpu_tools.py facts [--ceilings] [--json F]   machine, versions, GPU; matmul/copy ceilings
    gpu_tools.py procs --out F [--interval S]    sample per-process CPU (until killed)
    gpu_tools.py procs-summary F                 mean/max CPU per role from those samples
    gpu_tools.py trace-summary TRACE... [--json F]
        GPU busy time and the idle gaps between kernels, top kernels, top CPU ranges, from
        torch profiler traces (Chrome JSON, .gz or not): what bounds an engine step
    gpu_tools.py capacity REPORT [--criterion real-time]  a bench load report's capacity
        (its ``capacities``; a report from before the criteria: bench load --recompute first)
    gpu_tools.py predict ENGINE.json... [--variant V] [--engines K] [--mps on|off]
        "PUBLISHED REAL_TIME": the capacities a bench engine sweep predicts (where t(N)'s p50
        and p99 reach the 11.5 ms line), for K engines (default 1)
    gpu_tools.py best-engines ENGINE.json...   "K on|off PUBLISHED REAL_TIME": the engine
        count (and MPS or not) whose levels predict the most streams
    gpu_tools.py stamp FILE... --commit SHA [--facts F]  fill versions.git_commit where it is
        null, and machine/versions from the facts where a result has none
    gpu_tools.py check-out OUT [--expect NAME...]  what the device would not return of OUT,
        missing files, result JSON without machine, versions or commit (the rehearsal)
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
import platform
import re
import subprocess
import sys
import tarfile
import time
from collections import defaultdict
from pathlib import Path

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def _bench() -> None:
    """The checkout's ``bench`` importable (the recipe runs this script from the checkout):
    its result classes are the one owner of the results' format."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


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
    gpu = q.split(",")[0].strip() if isinstance(q, str) and q and "," in q else None
    facts["machine"] = {
        "gpu": gpu,
        "cpu_model": cpu,
        "cores": facts["cores"],
        "platform": platform.platform(),
    }
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


def capacity_of(report: dict, criterion: str = "real-time") -> int | None:
    """The capacity a bench load report states under ``criterion`` (published, real-time,
    interactive): its ``capacities``, read as bench.load.criteria.Capacity. None where it
    states none (a report from before the criteria: ``bench load --recompute`` gives them)."""
    _bench()
    import msgspec

    from bench.load.criteria import Capacity

    try:
        capacities = msgspec.convert(report.get("capacities") or [], list[Capacity])
    except msgspec.ValidationError:
        return None
    return next((c.concurrency for c in capacities if c.criterion == criterion), None)


def cmd_capacity(args: argparse.Namespace) -> int:
    try:
        report = json.loads(Path(args.report).read_text())
    except (OSError, json.JSONDecodeError):
        return 1
    _bench()
    from bench.load.criteria import CRITERIA

    if args.criterion not in CRITERIA:
        print(f"capacity: --criterion is one of {', '.join(CRITERIA)}", file=sys.stderr)
        return 2
    c = capacity_of(report, args.criterion)
    if c is None:
        return 1
    print(c)
    return 0


# One token per stream per engine step; 7 tokens make one 2048-sample frame at 24 kHz.
TOKENS_PER_AUDIO_S = 7 * 24000 / 2048  # 82.03: a step must take under 12.19 ms


def _cross(points: list[tuple[int, float]], line: float) -> float:
    """Where the step time t(N) reaches ``line``, linear between measured levels; below the
    smallest level, t is taken as proportional to N; above the largest, the last slope is
    extended, at most to twice the largest level."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no levels")
    n0, t0 = pts[0]
    if t0 >= line:
        return n0 * line / t0
    for (na, ta), (nb, tb) in itertools.pairwise(pts):
        if ta < line <= tb:
            return na + (nb - na) * (line - ta) / (tb - ta)
    nl, tl = pts[-1]
    if len(pts) >= 2:
        np_, tp = pts[-2]
        slope = (tl - tp) / (nl - np_)
        if slope > 0:
            return min(nl + (line - tl) / slope, 2 * nl)
    return 2 * nl


def engine_levels(engine: dict) -> list:
    """A bench engine result's ``levels``, read as bench.engine.results.Level (a level from
    before the engines dimension is one engine's)."""
    _bench()
    import msgspec

    from bench.engine.results import Level

    return msgspec.convert(engine.get("levels") or [], list[Level])


def predict(engine: dict, variant: str | None = None, line_ms: float | None = None,
            step: int = 8, engines: int = 1, mps: bool | None = None) -> dict:  # fmt: skip
    """Capacities the engine sweep predicts for the full server: published where the step's
    p50 reaches the real-time line (the mean RTF stays under 1), real-time where its p99
    does (bursts are what underrun). Predictions, to choose the confirmation's levels; a
    capacity is only ever a measured level. ``engines``: the levels of that engine count
    (their step times are the slowest engine's, at the total N); ``mps``: only the levels
    measured with (True) or without (False) CUDA MPS, for K > 1 (None: any). ``line_ms``:
    default bench engine's real-time line (11.5 ms: 6 % left for the codec and HTTP)."""
    _bench()
    from bench.engine.results import REAL_TIME_STEP_MS

    line_ms = REAL_TIME_STEP_MS if line_ms is None else line_ms
    levels = [lv for lv in engine_levels(engine) if lv.engines == engines]
    if mps is not None and engines > 1:
        levels = [lv for lv in levels if bool(lv.mps) == mps]
    names = list(dict.fromkeys(lv.variant for lv in levels))
    if variant is None:
        # llm.output_head auto serves the audio head wherever it is supported (the GPU)
        variant = next((v for v in ("audio-head", "full-head") if v in names), None)
        variant = variant or (names[0] if names else None)
    mine = [lv for lv in levels if lv.variant == variant]
    if not mine:
        raise ValueError(
            f"no levels of variant {variant!r} with {engines} engine(s) (have {names})"
        )
    out: dict = {"variant": variant, "line_ms": line_ms, "engines": engines, "mps": mps}
    for name, key in (("published", "step_ms_p50"), ("real-time", "step_ms_p99")):
        n = _cross([(lv.streams, getattr(lv, key)) for lv in mine], line_ms)
        out[name] = max(step, int(n // step * step))
    out["real-time"] = min(out["real-time"], out["published"])
    return out


def best_engines(engine: dict, variant: str | None = None,
                 line_ms: float | None = None) -> dict:  # fmt: skip
    """The engine count (and MPS or not) whose levels predict the most published-criterion
    streams, real-time capacity breaking ties, then fewer engines; with every candidate's
    prediction under ``candidates``."""
    setups = sorted({(lv.engines, bool(lv.mps) and lv.engines > 1)
                     for lv in engine_levels(engine)})  # fmt: skip
    candidates = []
    for k, mps in setups:
        try:
            candidates.append(predict(engine, variant, line_ms, engines=k, mps=mps))
        except ValueError:
            continue
    if not candidates:
        raise ValueError("no engine levels to choose from")
    best = max(candidates, key=lambda p: (p["published"], p["real-time"], -p["engines"]))
    return {**best, "mps": bool(best["mps"]), "candidates": candidates}


def _read_levels(files: list[str], who: str) -> dict:
    engine: dict = {"levels": []}
    for f in files:
        try:
            engine["levels"] += json.loads(Path(f).read_text()).get("levels", [])
        except (OSError, json.JSONDecodeError, AttributeError) as e:
            print(f"{who}: {f}: {e}", file=sys.stderr)
    return engine


def cmd_predict(args: argparse.Namespace) -> int:
    engine = _read_levels(args.engine, "predict")
    try:
        p = predict(engine, args.variant, args.line_ms, engines=args.engines,
                    mps=None if args.mps is None else args.mps == "on")  # fmt: skip
    except ValueError as e:
        print(f"predict: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(p))
    else:
        print(p["published"], p["real-time"])
    return 0


def cmd_best_engines(args: argparse.Namespace) -> int:
    try:
        b = best_engines(_read_levels(args.engine, "best-engines"), args.variant, args.line_ms)
    except ValueError as e:
        print(f"best-engines: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(b))
    else:
        print(b["engines"], "on" if b["mps"] else "off", b["published"], b["real-time"])
    return 0


def stamp(data: dict, commit: str | None, facts: dict | None) -> bool:
    """Fill what a result JSON lacks: versions.git_commit (the device's copy has no .git),
    and, from the call-1 facts, ``machine`` and ``versions`` where the JSON has none.
    True when something was added."""
    changed = False
    if facts:
        for key in ("machine", "versions"):
            if key not in data and isinstance(facts.get(key), dict):
                data[key] = dict(
                    facts[key], source="h100_facts.json (scripts/gpu/gpu_tools.py stamp)"
                )
                changed = True
    v = data.get("versions")
    if isinstance(v, dict) and not v.get("git_commit") and commit:
        v["git_commit"] = commit
        v["git_commit_source"] = "GIT_COMMIT given to scripts/gpu/run_capacity.sh"
        changed = True
    return changed


def cmd_stamp(args: argparse.Namespace) -> int:
    facts = None
    if args.facts:
        try:
            facts = json.loads(Path(args.facts).read_text())
        except (OSError, json.JSONDecodeError):
            facts = None
    for f in args.files:
        p = Path(f)
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(data, dict) and stamp(data, args.commit, facts):
            p.write_text(json.dumps(data, indent=2) + "\n")
    return 0


NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")


def check_out(out: Path, expect: list[str], max_files: int = 8) -> list[str]:
    """What the device tool would refuse or lose of a call's $OUT (at most 8 files, 16 MiB
    each, 64 MiB in all, two folders down, plain names), and whether each expected file is
    there and each result JSON carries machine, versions and a commit. Empty: all good."""
    problems: list[str] = []
    files = [p for p in out.rglob("*") if p.is_file()]
    if len(files) > max_files:
        problems.append(f"{len(files)} files under $OUT; {max_files} come back")
    total = 0
    for p in files:
        rel = p.relative_to(out)
        size = p.stat().st_size
        total += size
        if size > 16 * MIB:
            problems.append(f"{rel}: {size / MIB:.1f} MiB > 16 MiB")
        if len(rel.parts) > 3:
            problems.append(f"{rel}: more than two folders down")
        if not all(NAME_OK.match(part) for part in rel.parts):
            problems.append(f"{rel}: a name outside [A-Za-z0-9._-]")
        if p.suffix == ".json" and p.name.startswith("h100_"):
            try:
                data = json.loads(p.read_text())
            except (OSError, json.JSONDecodeError) as e:
                problems.append(f"{rel}: not JSON ({e})")
                continue
            if not isinstance(data, dict):
                continue
            for key in ("machine", "versions"):
                if not isinstance(data.get(key), dict):
                    problems.append(f"{rel}: no {key}")
            v = data.get("versions") if isinstance(data.get("versions"), dict) else {}
            if not (v.get("git_commit") or data.get("git_commit")):
                problems.append(f"{rel}: no commit")
            levels = data.get("levels")
            if str(data.get("schema", "")).startswith("orpheus-serve/bench-load/"):
                if not any(isinstance(lv, dict) and lv.get("requests") for lv in levels or []):
                    problems.append(f"{rel}: no level measured a request")
            if data.get("benchmark") == "engine":
                ran = [v for v in data.get("variants") or [] if v.get("status") == "ok"]
                if not ran or not levels:
                    problems.append(f"{rel}: no variant measured")
    if total > 64 * MIB:
        problems.append(f"{total / MIB:.1f} MiB in all > 64 MiB")
    names = {p.name for p in files}
    for e in expect:
        if e not in names:
            problems.append(f"{e}: missing")
    return problems


def cmd_check_out(args: argparse.Namespace) -> int:
    problems = check_out(Path(args.out), args.expect)
    for pr in problems:
        print(f"check-out: {pr}")
    if not problems:
        print(f"check-out: {args.out} ok ({', '.join(sorted(args.expect)) or 'no file expected'})")
    return 1 if problems else 0


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
    s.add_argument("--criterion", default="real-time",
                   help="published, real-time (default) or interactive")  # fmt: skip
    s = sub.add_parser("predict")
    s.add_argument("engine", nargs="+", help="bench engine JSON file(s)")
    s.add_argument("--variant", default=None, help="default: audio-head, else full-head")
    s.add_argument("--line-ms", type=float, default=None)
    s.add_argument("--engines", type=int, default=1, help="the levels of K engines")
    s.add_argument("--mps", choices=["on", "off"], default=None,
                   help="K > 1: only the levels measured with / without CUDA MPS")  # fmt: skip
    s.add_argument("--json", action="store_true", help="the whole prediction as JSON")
    s = sub.add_parser("best-engines", help="the engine count (and MPS) predicting the most "
                       "streams: prints K, on|off, published, real-time")  # fmt: skip
    s.add_argument("engine", nargs="+", help="bench engine JSON file(s)")
    s.add_argument("--variant", default=None, help="default: audio-head, else full-head")
    s.add_argument("--line-ms", type=float, default=None)
    s.add_argument("--json", action="store_true", help="the whole choice as JSON")
    s = sub.add_parser("stamp")
    s.add_argument("files", nargs="+")
    s.add_argument("--commit", default=os.environ.get("GIT_COMMIT"))
    s.add_argument("--facts", default=None, help="h100_facts.json: machine and versions")
    s = sub.add_parser("check-out")
    s.add_argument("out")
    s.add_argument("--expect", nargs="*", default=[])
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
        "predict": cmd_predict,
        "best-engines": cmd_best_engines,
        "stamp": cmd_stamp,
        "check-out": cmd_check_out,
        "pack": cmd_pack,
    }[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
