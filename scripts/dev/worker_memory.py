"""Drive one engine with the soak's shapes and record how vLLM's processes' memory moves.

The engine is built as the llm worker builds it (:func:`llm_worker.engine.plan.plan_engine`,
:meth:`llm_worker.engine.engine.GenerationEngine.start`, the ``--device`` profile
of the server's configuration), in this process; vLLM's engine core and worker are its
children. Waves of requests follow one another until ``--duration``: each wave has a random
number of streams (1 to ``--max-streams``; every ``--flood-every``-th wave all of them, like
the soak's floods), prompts from texts of random length, a random token budget, and a
fraction ``--cancel`` of its requests aborted part-way. The project's vLLM plugin loads
:mod:`common.memory_probe` into every vLLM process (``ORPHEUS_PROFILE_MEMORY``), which
samples RSS, the ``[heap]``, glibc's ``mallinfo2`` and the collector's object counts.

    PYTHONPATH=. python scripts/dev/worker_memory.py --model DIR --duration 600 \\
        --label baseline --json docs/results/worker_memory_baseline.json

Run the variants to compare (an allocator in ``LD_PRELOAD``, ``MALLOC_*`` settings) under the
same command, one after another or side by side; the JSON keeps every sample of every vLLM
process, the requests served and the environment that differs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.memory_probe import ENV as PROBE_ENV
from common.memory_probe import EVERY_ENV, TYPES_ENV

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven bright stars sing softly "
    "above quiet hills and rivers that wander toward distant cities of glass"
).split()
ENV_KEYS = (
    "LD_PRELOAD", "MALLOC_ARENA_MAX", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TOP_PAD_", "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY",
    "ORPHEUS_WORKER_HEAP_TRIM_S",
)  # fmt: skip


def texts(rng: random.Random, n: int) -> list[str]:
    """``n`` texts of 1 to 60 words (prompt lengths spread like the soak's mix)."""
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


async def one(
    engine: Any,
    hooks: Any,
    rid: str,
    prompt: list[int],
    make_params: Callable[[Any], Any],
    cancel_after: float | None,
) -> int:
    """A request to its end, or aborted ``cancel_after`` seconds in (its slot on the sampling
    board held meanwhile, like a worker's stream). Returns the tokens read."""
    counter = hooks.acquire()
    try:
        collector = await engine.add(rid, prompt, make_params(counter))
        tokens = 0
        start = time.monotonic()
        while True:
            left = None if cancel_after is None else cancel_after - (time.monotonic() - start)
            if left is not None and left <= 0:
                await engine.abort(rid)
                return tokens
            try:
                async with asyncio.timeout(left):
                    out = await collector.get()
            except TimeoutError:
                continue
            tokens += len(out.outputs[0].token_ids)
            if out.finished:
                return tokens
    finally:
        if counter is not None:
            hooks.release(counter)


async def drive(args: argparse.Namespace) -> dict[str, Any]:
    from llm_worker.engine.engine import GenerationEngine
    from llm_worker.engine.plan import plan_engine
    from llm_worker.prompt import PromptBuilder
    from llm_worker.requests import RequestPlan, segment_params
    from orchestrator.settings import load_config

    llm = {"model": args.model, "max_num_seqs": args.max_streams, "max_model_len": 1024}
    cfg = load_config(None, {"device": args.device, "llm": llm}).llm
    plan = plan_engine(cfg, f"worker-memory-{os.getpid()}", args.device)
    sampling = plan.sampling
    generation = GenerationEngine.start(cfg, args.device, plan)
    rng = random.Random(args.seed)
    builder = PromptBuilder.from_pretrained(cfg.tokenizer or cfg.model)
    voice = cfg.default_voice
    pool = texts(rng, 64)
    prompts = builder.build_many(voice, pool)
    vs = cfg.voice_sampling.get(voice, cfg.sampling)
    served = cancelled = tokens = waves = 0
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < args.duration:
            waves += 1
            flood = args.flood_every > 0 and waves % args.flood_every == 0
            n = args.max_streams if flood else rng.randint(1, max(1, args.max_streams // 4))
            jobs = []
            for i in range(n):
                k = rng.randrange(len(prompts))
                budget = rng.randint(4, 100) * 7
                plan = RequestPlan(
                    voice=voice, kind="model", sampling=vs, seed=None, total_tokens=budget,
                )  # fmt: skip

                def make_params(counter: Any, plan: Any = plan, k: int = k) -> Any:
                    kwargs = sampling.hooks.kwargs(vs, counter)
                    return segment_params(
                        cfg, plan, 0, len(pool[k]), len(prompts[k]), plan.total_tokens, kwargs,
                        generation.space.end_of_speech,
                    )  # fmt: skip

                cut = rng.uniform(0.2, 3.0) if rng.random() < args.cancel else None
                cancelled += cut is not None
                jobs.append(
                    one(generation, sampling.hooks, f"w{waves}-{i}", prompts[k], make_params, cut)
                )
            tokens += sum(await asyncio.gather(*jobs))
            served += n
            if rng.random() < 0.2:
                await asyncio.sleep(rng.uniform(0.5, 3.0))
    finally:
        ended = time.time()
        generation.llm.shutdown()
        gc.collect()  # the requests' board slots, before the board is unmapped
        try:
            sampling.close()
        except BufferError as e:  # a view still alive: the segment goes with the process
            print(f"sampling board not closed: {e}")
    return {
        "requests": served, "cancelled": cancelled, "tokens": tokens, "waves": waves,
        "ended": ended,
    }  # fmt: skip


def slim(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample as the JSON keeps it: RSS, anonymous, heap, malloc totals, object count."""
    if "rollup" not in sample:
        return sample
    out = {k: sample[k] for k in ("t", "name", "heap_rss", "objects_total") if k in sample}
    out.update({k: sample["rollup"].get(k, 0) for k in ("Rss", "Anonymous")})
    if "malloc" in sample:
        keys = ("arena", "uordblks", "fordblks", "hblkhd")
        out["malloc"] = {k: sample["malloc"][k] for k in keys}
    return out


def summarize(samples: list[dict[str, Any]], warmup_s: float, ended: float) -> dict[str, Any]:
    """First sample after the warm-up against the last before the engine's shutdown (at
    ``ended``): RSS, heap, malloc, object types."""
    good = [s for s in samples if "rollup" in s and s["t"] <= ended]
    t0 = good[0]["t"]
    after = [s for s in good if s["t"] - t0 >= warmup_s] or good[-1:]
    a, b = after[0], good[-1]

    def mb(x: float) -> float:
        return round(x / 1e6, 1)

    out: dict[str, Any] = {"name": b["name"], "window_s": round(b["t"] - a["t"], 1)}
    for key in ("Rss", "Anonymous", "Private_Dirty"):
        out[f"{key}_mb"] = [mb(a["rollup"].get(key, 0)), mb(b["rollup"].get(key, 0))]
    out["heap_rss_mb"] = [mb(a["heap_rss"]), mb(b["heap_rss"])]
    if "malloc" in a:
        for key in ("arena", "uordblks", "fordblks", "hblkhd"):
            out[f"malloc_{key}_mb"] = [mb(a["malloc"][key]), mb(b["malloc"][key])]
    if "objects" in a and "objects" in b:
        names = set(a["objects"]) | set(b["objects"])
        grew = {n: b["objects"].get(n, 0) - a["objects"].get(n, 0) for n in names}
        out["objects_total"] = [a["objects_total"], b["objects_total"]]
        out["objects_grew"] = dict(sorted(grew.items(), key=lambda kv: -abs(kv[1]))[:8])
    hours = max(b["t"] - a["t"], 1.0) / 3600
    out["rss_slope_mb_per_h"] = round((b["rollup"]["Rss"] - a["rollup"]["Rss"]) / 1e6 / hours, 1)
    return out


def _repo_relative(value: str) -> str:
    """``value`` with this checkout's absolute path taken out (the JSON is committed)."""
    return value.replace(str(Path(__file__).resolve().parents[2]) + os.sep, "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--duration", type=float, default=600)
    ap.add_argument("--warmup", type=float, default=120, help="seconds before the base sample")
    ap.add_argument("--max-streams", type=int, default=64)
    ap.add_argument("--flood-every", type=int, default=6, help="every Nth wave has them all")
    ap.add_argument("--cancel", type=float, default=0.25)
    ap.add_argument("--every", type=float, default=10, help="probe sampling period, s")
    ap.add_argument("--types", type=int, default=25, help="object types counted (0: none)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--label", default="run")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    probe_dir = Path(tempfile.mkdtemp(prefix="worker-memory-"))
    os.environ[PROBE_ENV] = str(probe_dir)
    os.environ[EVERY_ENV] = str(args.every)
    os.environ[TYPES_ENV] = str(args.types)
    try:
        import uvloop

        load = uvloop.run(drive(args))
        procs = {}
        for f in sorted(probe_dir.glob("*.jsonl")):
            samples = [json.loads(line) for line in f.read_text().splitlines() if line]
            if samples:
                procs[f.stem] = samples
    finally:
        shutil.rmtree(probe_dir, ignore_errors=True)
    summary = {pid: summarize(s, args.warmup, load["ended"]) for pid, s in procs.items()}
    for pid, s in summary.items():
        print(f"{args.label} {s['name']} ({pid}): " + ", ".join(
            f"{k} {v}" for k, v in s.items() if k not in ("name", "objects_grew")
        ))  # fmt: skip
        if s.get("objects_grew"):
            print(f"    objects grew: {s['objects_grew']}")
    print(f"{args.label}: {load}, load average {os.getloadavg()}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "label": args.label, "args": {k: str(v) for k, v in vars(args).items()},
            "env": {k: _repo_relative(os.environ[k]) for k in ENV_KEYS if k in os.environ},
            "load": load, "loadavg_end": os.getloadavg(), "summary": summary,
            "samples": {pid: [slim(x) for x in s] for pid, s in procs.items()},
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
