"""An offline vLLM engine's start as the tests build it (the tiny model, eager, an explicit KV
size), with TorchInductor's ISA checks made in the process against remembered from an earlier
one (``llm_worker.vllm_ext.vec_isa``), the two arms alternated.

    .venv-vllm025/bin/python scripts/dev/engine_start.py --pairs 2 \\
        --json docs/results/vec_isa_engine_start_vllm025_cpu.json

The ``checked`` arm removes the remembered verdicts (``orpheus-vec-isa/`` in torch's cache
directory) before its start, so its process checks as torch does by itself (and writes them
again); the ``remembered`` arm keeps them. vLLM 0.25's CPU worker warms the model up at every
start, and its dummy sampler run compiles; vLLM 0.32 compiles nothing there, so run it with
the 0.25.1 environment. Needs ``runs/tiny-model`` (``orpheus-serve tiny-model``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")


def one_start() -> None:
    """In a process of its own: build the engine, print its time."""
    sys.path[:0] = [str(ROOT / "tests" / "harness"), str(ROOT)]
    from offline_engine import offline_llm

    t = time.monotonic()
    llm = offline_llm(model="runs/tiny-model", dtype="float32", max_model_len=256,
                      max_num_seqs=8, kv_cache_memory_bytes=64 << 20, enforce_eager=True,
                      seed=0, skip_tokenizer_init=True)  # fmt: skip
    print(f"ENGINE {time.monotonic() - t:.2f}", flush=True)
    del llm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--json", type=Path)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        one_start()
        return 0
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    from llm_worker.vllm_ext.vec_isa import DIR_NAME

    verdicts = Path(cache_dir()) / DIR_NAME
    # vLLM's ipc sockets and rendezvous files go here, removed at the end (not in /tmp).
    tmp = tempfile.mkdtemp(prefix="engine-start-")
    try:
        return _alternate(a, verdicts, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _alternate(a: argparse.Namespace, verdicts: Path, tmp: str) -> int:
    runs = []
    for pair in range(a.pairs):
        for arm in ("checked", "remembered"):
            if arm == "checked":
                shutil.rmtree(verdicts, ignore_errors=True)
            env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=tmp, VLLM_RPC_BASE_PATH=tmp)
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--one"],
                env=env, cwd=ROOT, capture_output=True, text=True, check=False,
            )  # fmt: skip
            engine = re.search(r"^ENGINE ([\d.]+)$", out.stdout, re.M)
            init = INIT.search(out.stdout + out.stderr)
            if out.returncode or engine is None:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            run = {"pair": pair + 1, "arm": arm, "engine_s": float(engine.group(1)),
                   "init_engine_s": float(init.group(1)) if init else None}  # fmt: skip
            runs.append(run)
            print(f"pair {pair + 1} {arm:10s}: engine {run['engine_s']:.1f} s, "
                  f"vLLM's init engine {run['init_engine_s']} s", flush=True)  # fmt: skip
    if a.json:
        import torch
        import vllm

        a.json.write_text(json.dumps({
            "command": f"scripts/dev/engine_start.py --pairs {a.pairs}",
            "vllm": vllm.__version__, "torch": torch.__version__, "runs": runs,
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
