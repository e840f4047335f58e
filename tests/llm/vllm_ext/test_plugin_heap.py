"""The vLLM plugin freezes the import's heap in the processes vLLM starts (its engine core, its
workers: multiprocessing children) and nowhere else (the llm worker, a test's process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import gc
import multiprocessing as mp

from llm_worker.vllm_ext.plugin import freeze_import_heap


def child(q):
    freeze_import_heap()
    q.put(gc.get_freeze_count())


if __name__ == "__main__":
    freeze_import_heap()
    assert gc.get_freeze_count() == 0, "a process nobody started with multiprocessing froze"
    ctx = mp.get_context("spawn")  # as vLLM starts its processes on CPU, and once CUDA is up
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    frozen = q.get(timeout=60)
    p.join(60)
    assert p.exitcode == 0 and frozen > 1000, (p.exitcode, frozen)
    print("ok")
"""


def test_only_a_process_vllm_started_freezes_its_import_heap(tmp_path: Path) -> None:
    script = tmp_path / "freeze.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
