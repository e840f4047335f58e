#!/usr/bin/env python3
"""Start-up checks of the GPU path, for the device (real CUDA) and for the CPU rehearsal.

    python scripts/gpu/preflight.py [--cuda-answers] [--json FILE]

Each check does what the server does at start-up and fails the way the server would:

- ``imports``: every module of the project's packages imports.
- ``sampling``: for ``llm.model_runner`` v1 and v2 on ``cuda``, the runner is chosen and
  pinned, the plan is selected and its logits-processor classes import (the first GPU start
  died here: V2 imported a module vLLM 0.25 lacks).
- ``sampler``: vLLM's V1 Sampler is built with the recipe's environment (the second death:
  on CUDA it imported flashinfer, which is not carried).
- ``codec_compile`` (``--codec-compile``): torch.compile of the codec decoder on every hot
  shape and batch bucket, timed (what the codec worker does before it is ready).
- ``staging`` (real CUDA only): a pinned staging buffer is not refilled while a queued copy
  still reads it (see llm_worker/vllm_ext/sampling/staging.py); a naive reuse is shown to corrupt.

``--cuda-answers`` (CPU rehearsal): vLLM's platform answers what the CUDA platform answers
on an H100 (``is_cuda``, compute capability 9.0, Triton present) wherever these checks ask,
so the GPU code paths are taken on a CPU.

Exit status 0 when every check passed; the JSON has one entry per check and ``ok``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import pkgutil
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PACKAGES = (
    "orpheus_wire", "shm", "store", "common", "orchestrator", "orpheus_client", "llm_worker",
    "codec_worker", "gateway", "testkit", "bench", "orpheus_serve",
)  # fmt: skip
SKIP_MODULES = (
    "bench.compare.baseline.__main__",
    "bench.engine.__main__",
    "orpheus_serve.__main__",
)


@contextlib.contextmanager
def cuda_answers() -> Iterator[None]:
    """vLLM's platform and Triton flag answering as on an H100 (CPU rehearsal only)."""
    from unittest import mock

    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    from llm_worker.vllm_ext.sampling import runner

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(current_platform, "is_cuda", lambda: True))
        stack.enter_context(
            mock.patch.object(
                current_platform,
                "get_device_capability",
                lambda device_id=0: DeviceCapability(9, 0),
            )
        )
        stack.enter_context(mock.patch.object(runner, "v2_available", lambda device: True))
        yield


FA_EXTENSIONS_MISSING = "requires the CUDA flash attention extensions"


def fa3_needs_the_driver() -> str | None:
    """Why vLLM's FlashAttention 3 extension cannot load here, when the reason is that this
    machine has no CUDA driver (the CPU rehearsal); None when it loads or fails otherwise."""
    import ctypes
    import importlib.util

    import torch  # noqa: F401 - the extension links against libtorch

    spec = importlib.util.find_spec("vllm")  # the parent package would raise: not imported
    if spec is None or spec.origin is None:
        return None
    found = sorted(Path(spec.origin).parent.glob("vllm_flash_attn/_vllm_fa3_C*.so"))
    if not found:
        return None
    try:
        ctypes.CDLL(str(found[0]))
    except OSError as e:
        return str(e) if "libcuda" in str(e) else None
    return None


def check_imports(cuda_answers: bool = False) -> dict[str, Any]:
    """Every module of the project imports. With ``cuda_answers`` (a CPU rehearsal), a module
    that fails only because vLLM's FlashAttention extension needs the CUDA driver is listed
    under ``needs_cuda``, not as a failure: call 3 on the device imports it for real."""
    from llm_worker.vllm_ext.sampling.runner import v2_processors_supported

    skip = set(SKIP_MODULES)
    if not v2_processors_supported():  # only imported where vLLM has the V2 interface
        skip.add("llm_worker.vllm_ext.sampling.constraint_v2")
    failed: dict[str, str] = {}
    count = 0
    for pkg in PACKAGES:
        mod = importlib.import_module(pkg)
        for info in pkgutil.walk_packages(mod.__path__, prefix=f"{pkg}."):
            if info.name in skip:
                continue
            count += 1
            try:
                importlib.import_module(info.name)
            except Exception as e:  # report every failure
                failed[info.name] = f"{type(e).__name__}: {e}"
    needs_cuda: dict[str, str] = {}
    if cuda_answers and any(FA_EXTENSIONS_MISSING in v for v in failed.values()):
        why = fa3_needs_the_driver()
        if why is not None:
            for name in [k for k, v in failed.items() if FA_EXTENSIONS_MISSING in v]:
                needs_cuda[name] = f"{failed.pop(name)} (_vllm_fa3_C: {why})"
    return {"ok": not failed, "modules": count, "failed": failed, "needs_cuda": needs_cuda}


def check_sampling() -> dict[str, Any]:
    import os

    from common.config.llm import LLMConfig
    from llm_worker.vllm_ext.sampling import SamplingPlan, choose_model_runner, pin_model_runner

    out: dict[str, Any] = {"ok": True}
    saved = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    try:
        for setting in ("auto", "v1", "v2"):
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
            choice = choose_model_runner(setting, "cuda")
            pin_model_runner(choice.runner)
            plan = SamplingPlan.for_config(
                LLMConfig(), choice.runner, v2_processors=choice.v2_processors
            )
            procs = [p.__name__ for p in plan.logits_processors()]
            out[setting] = {
                "runner": str(choice.runner),
                "processors": procs,
                "describe": plan.describe(),
                "reason": choice.reason,
            }
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
        if saved is not None:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = saved
    return out


def check_sampler() -> dict[str, Any]:
    import os

    from vllm.v1.sample.ops.topk_topp_sampler import flashinfer_sampler_supported
    from vllm.v1.sample.sampler import Sampler

    from llm_worker.engine.env import prepare_engine_environment

    prepare_engine_environment()
    sampler = Sampler()  # V1's
    native = sampler.topk_topp_sampler.forward == sampler.topk_topp_sampler.forward_native
    return {
        "ok": True,
        # the decision V2's sampler (vllm.v1.worker.gpu.sample.sampler) makes the same way
        "v2_uses_flashinfer": flashinfer_sampler_supported(),
        "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER"),
        "top_p_sampler": "native (PyTorch/Triton)" if native else "flashinfer or platform kernel",
    }


def check_staging() -> dict[str, Any]:
    """A queued copy must read what the host held when ``upload`` was called."""
    import torch

    from llm_worker.vllm_ext.sampling.staging import Staged

    n, cycles = 4096, 200_000_000  # ~0.1 s of GPU sleep ahead of the copies
    dev = torch.device("cuda")
    # The hazard, shown with a naive reuse of one pinned buffer.
    host = torch.zeros(n, dtype=torch.int64, pin_memory=True)
    dst = torch.empty(n, dtype=torch.int64, device=dev)
    torch.cuda._sleep(cycles)
    host.fill_(1)
    dst.copy_(host, non_blocking=True)
    host.fill_(2)  # the next step's values, written before the queued copy ran
    torch.cuda.synchronize()
    naive_corrupt = bool((dst != 1).any())
    # The staged buffers.
    s = Staged(n, torch.int64, dev)
    torch.cuda._sleep(cycles)
    got = []
    for v in (1, 2, 3, 4):
        s.np[:] = v
        got.append(s.upload(n).clone())
    torch.cuda.synchronize()
    values = [int(g.min()) if bool((g == g[0]).all()) else -1 for g in got]
    return {
        "ok": values == [1, 2, 3, 4],
        "values": values,
        "waits": s.waits,
        "naive_reuse_corrupts": naive_corrupt,
    }


def check_codec_compile() -> dict[str, Any]:
    """torch.compile of the codec decoder on every hot shape and batch bucket, as the codec
    worker does at start with ``codec.compile = true`` (random SNAC weights)."""
    import tempfile

    import torch

    from codec_worker.decoder import WindowDecoder
    from codec_worker.engine import DecodeEngine
    from codec_worker.policy import WindowPolicy
    from codec_worker.snac_model import load_snac
    from common.config.codec import CodecConfig
    from testkit.tiny_model import write_random_snac

    cfg = CodecConfig(compile=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="orpheus-snac-") as tmp:
        write_random_snac(Path(tmp) / "snac", seed=0)
        decoder = WindowDecoder(load_snac(str(Path(tmp) / "snac"), "cpu"))
    engine = DecodeEngine.for_config(decoder, cfg, device)
    seconds = engine.warmup()
    keys = WindowPolicy(cfg).hot_keys()
    return {
        "ok": True,
        "device": str(device),
        "hot_shapes": [f"{k.context}+{k.hop}+{k.lookahead}" for k in keys],
        "batch_buckets": list(cfg.batch_buckets),
        "warmup_s": round(seconds, 1),
    }


def run(checks: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, fn in checks.items():
        t0 = time.perf_counter()
        try:
            r = fn()
        except Exception as e:
            r = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(limit=6),
            }
        r["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = r
        print(f"preflight {name}: {'ok' if r['ok'] else 'FAILED ' + r.get('error', '')}")
    results["ok"] = all(r["ok"] for r in results.values() if isinstance(r, dict))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cuda-answers", action="store_true", help="CPU rehearsal of the GPU path")
    p.add_argument("--json", help="write the results here")
    p.add_argument(
        "--codec-compile",
        action="store_true",
        help="also compile the codec decoder on every hot shape and bucket (minutes on a CPU)",
    )
    p.add_argument("--only", help="run only these checks (comma list of names)")
    args = p.parse_args(argv)
    checks: dict[str, Callable[[], dict[str, Any]]] = {
        "imports": lambda: check_imports(cuda_answers=args.cuda_answers),
        "sampling": check_sampling,
        "sampler": check_sampler,
    }
    import torch

    if torch.cuda.is_available() and not args.cuda_answers:
        checks["staging"] = check_staging
    if args.codec_compile or (args.only and "codec_compile" in args.only.split(",")):
        checks["codec_compile"] = check_codec_compile
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - set(checks)
        if unknown:
            p.error(f"unknown or unavailable checks: {sorted(unknown)}")
        checks = {k: v for k, v in checks.items() if k in wanted}
    ctx = cuda_answers() if args.cuda_answers else contextlib.nullcontext()
    with ctx:
        results = run(checks)
    results["cuda_answers"] = args.cuda_answers
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    print(f"preflight: {'all checks passed' if results['ok'] else 'FAILED'}")
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
