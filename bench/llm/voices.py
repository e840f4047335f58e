"""``orpheus-serve bench voices [--json FILE]``: what custom voices cost.

Two measurements (tiny Orpheus-vocabulary model, random weights, CPU build):

- ``ttfb``: a custom (zero-shot) voice's time to first audio byte, first use vs reuse, with
  vLLM's prefix cache on and off. The whole server runs (``orpheus-serve serve``, one start per
  variant); ``--voices`` voices are made from ``--ref-seconds`` clips, each is spoken once
  (first use: the reference turn is prefilled) and then ``--reuses`` more times with other
  text (reuse: with the cache, only the new turn is prefilled). A built-in voice (a ~15-token
  prompt) is interleaved as the floor. Requests are sequential, one at a time.
- ``prefill``: the same comparison in the engine alone (in-process, CPU time of the steps up
  to a request's first token), without the pipeline's fixed costs around it.
- ``lora``: the engine step cost with 0, 1 and 4 active LoRA adapters at ``--streams``
  streams, against an engine without LoRA. One in-process engine per variant, stepped in
  lockstep (one decode step of each variant, order rotated every step) so that the shared
  machine's load falls on all variants alike; the step cost is the process CPU time of
  ``LLMEngine.step()``. Adapters are random (``orpheus-serve tiny-model --lora``), rank 8, on
  every linear layer.

Prints a table per part and writes JSON (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import environment, write_json
from bench.llm.lockstep import (
    KV_BYTES_PER_TOKEN,
    TEXTS,
    add_lockstep_arguments,
    paired_median,
    step_in_lockstep,
)
from llm_worker.engine.env import own_vllm_sockets
from testkit.clips import reference_clip

LORA_VARIANTS = ("no-lora", "0 adapters", "1 adapter", "4 adapters")
LORA_RANK = 8


# -- TTFB ----------------------------------------------------------------------------------------


_NO_STORE = {"Cache-Control": "no-store"}
"""The texts repeat across variants: synthesised each time, not answered by the sentence
audio cache (``bench.load.clients.NO_STORE``, not imported: aiohttp is imported lazily)."""


async def _ttfb(url: str, voice: str, text: str, seed: int) -> float:
    import aiohttp

    body = {"model": "tts-1", "input": text, "voice": voice, "response_format": "pcm",
            "max_tokens": 7 * 4, "seed": seed}  # fmt: skip
    async with aiohttp.ClientSession() as s:
        t0 = time.perf_counter()
        async with s.post(f"{url}/v1/audio/speech", json=body, headers=_NO_STORE) as r:
            if r.status != 200:
                raise RuntimeError(f"{voice}: {r.status} {await r.text()}")
            await r.content.readany()
            ttfb = time.perf_counter() - t0
            await r.read()
    return ttfb


async def _create(url: str, name: str, audio: bytes) -> dict[str, Any]:
    import aiohttp

    form = aiohttp.FormData()
    form.add_field("name", name)
    form.add_field("transcript", "This is the reference clip of a benchmark voice.")
    form.add_field("audio", audio, filename="ref.wav", content_type="audio/wav")
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{url}/v1/audio/voices", data=form) as r:
            body = await r.json()
            if r.status != 201:
                raise RuntimeError(f"creating {name}: {r.status} {body}")
            return body


async def _ttfb_variant(url: str, args: argparse.Namespace) -> dict[str, Any]:
    for i in range(2):  # warm the path (and the cache of the built-in voice's prefix)
        await _ttfb(url, "tara", TEXTS[i], i)
    first, reuse, builtin = [], [], []
    tokens = 0
    for v in range(args.voices):
        made = await _create(
            url, f"bench{v}", reference_clip(args.ref_seconds, 24_000, 150.0 + 40 * v)
        )
        tokens = made["frames"] * 7
        first.append(await _ttfb(url, f"bench{v}", TEXTS[v % len(TEXTS)], 100 + v))
        for k in range(args.reuses):
            text = TEXTS[(v + k + 1) % len(TEXTS)]
            reuse.append(await _ttfb(url, f"bench{v}", f"{text} ({k})", 200 + k))
            builtin.append(await _ttfb(url, "tara", f"{text} ({k})", 300 + k))
    return {
        "reference_audio_tokens": tokens,
        "first_use_s": first,
        "reuse_s": reuse,
        "builtin_s": builtin,
        "first_use_median_s": statistics.median(first),
        "reuse_median_s": statistics.median(reuse),
        "builtin_median_s": statistics.median(builtin),
    }


def run_ttfb(args: argparse.Namespace, model: Path, work: Path) -> dict[str, Any]:
    from bench.load.servers import ServerProcess, orpheus_serve_argv
    from testkit.local_server import free_port

    out: dict[str, Any] = {}
    for name, cache in (("prefix cache on", True), ("prefix cache off", False)):
        port = free_port()
        extra = [
            "--set", f"voices.state_dir={work / ('state-' + str(cache))}",
            "--set", f"llm.enable_prefix_caching={'true' if cache else 'false'}",
        ]  # fmt: skip
        argv = orpheus_serve_argv(str(model), str(model / "snac"), "cpu", port, extra)
        srv = ServerProcess(name, argv, f"http://127.0.0.1:{port}", work / f"server-{cache}.log")
        with srv:
            srv.wait_ready(900)
            print(f"{name}: server ready after {srv.ready_after_s:.0f} s", flush=True)
            out[name] = asyncio.run(_ttfb_variant(srv.url, args))
    return out


def print_ttfb(res: dict[str, Any]) -> None:
    print("\ncustom voice TTFB (s, median; sequential requests, tiny model on CPU)")
    print(f"{'variant':<18}{'ref tokens':>11}{'first use':>11}{'reuse':>9}{'built-in':>10}"
          f"{'reuse/first':>13}")  # fmt: skip
    for name, r in res.items():
        ratio = r["reuse_median_s"] / r["first_use_median_s"]
        print(f"{name:<18}{r['reference_audio_tokens']:>11}{r['first_use_median_s']:>11.3f}"
              f"{r['reuse_median_s']:>9.3f}{r['builtin_median_s']:>10.3f}{ratio:>13.2f}")  # fmt: skip
    if len(res) == 2:
        on, off = res["prefix cache on"], res["prefix cache off"]
        print(f"reuse, cache off / cache on: {off['reuse_median_s'] / on['reuse_median_s']:.2f}x")


# -- prefill of the reference turn, in the engine alone ----------------------------------------


def run_prefill(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Time to the first token in the engine alone (in-process, CPU ms of the steps until the
    request's first token): a custom voice's first request vs later ones, cache on and off."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    own_vllm_sockets()
    from vllm import EngineArgs, LLMEngine, SamplingParams

    from llm_worker.prompt import PromptBuilder

    builder = PromptBuilder.from_pretrained(str(model))
    rng = np.random.default_rng(0)
    frames = int(args.ref_seconds * 24_000 / 2048) + 1
    prefixes = [
        builder.build_reference(
            "This is the reference clip of a benchmark voice.",
            rng.integers(0, 4096, size=(frames, 7)),
        )
        for _ in range(args.voices)
    ]
    out: dict[str, Any] = {"reference_prompt_tokens": len(prefixes[0])}
    # Both engines first (a second in-process engine cannot be built after the first is gone).
    engines = {
        name: LLMEngine.from_engine_args(
            EngineArgs(
                model=str(model), dtype="float32", max_model_len=2048, max_num_seqs=4,
                kv_cache_memory_bytes=64 << 20, enforce_eager=True, seed=0,
                enable_prefix_caching=cache,
            )
        )
        for name, cache in (("prefix cache on", True), ("prefix cache off", False))
    }  # fmt: skip
    ids = iter(range(1, 1 << 30))

    def first_token_ms(engine: Any, prompt: list[int]) -> float:
        n = next(ids)
        params = SamplingParams(max_tokens=1, temperature=0.6, seed=n)
        engine.add_request(str(n), {"prompt_token_ids": prompt}, params)
        c0 = time.process_time()
        while engine.has_unfinished_requests():
            engine.step()
        return (time.process_time() - c0) * 1e3

    times: dict[str, dict[str, list[float]]] = {
        name: {"first": [], "reuse": [], "builtin": []} for name in engines
    }
    for engine in engines.values():
        first_token_ms(engine, builder.build("tara", "Warm up."))
    for v, prefix in enumerate(prefixes):  # the variants alternate request by request
        for name, engine in engines.items():
            times[name]["first"].append(
                first_token_ms(engine, [*prefix, *builder.build_plain(TEXTS[v])])
            )
        for k in range(args.reuses):
            text = f"{TEXTS[(v + k + 1) % len(TEXTS)]} ({k})"
            for name, engine in engines.items():
                t = times[name]
                t["reuse"].append(first_token_ms(engine, [*prefix, *builder.build_plain(text)]))
                t["builtin"].append(first_token_ms(engine, builder.build("tara", text)))
    for name, t in times.items():
        out[name] = {
            "first_use_ms": t["first"],
            "reuse_ms": t["reuse"],
            "builtin_ms": t["builtin"],
            "first_use_median_ms": statistics.median(t["first"]),
            "reuse_median_ms": statistics.median(t["reuse"]),
            "builtin_median_ms": statistics.median(t["builtin"]),
        }
    return out


def print_prefill(res: dict[str, Any]) -> None:
    print(
        f"\nengine time to first token (CPU ms, median; reference turn "
        f"{res['reference_prompt_tokens']} tokens, in-process engine)"
    )
    print(f"{'variant':<18}{'first use':>11}{'reuse':>9}{'built-in':>10}{'reuse/first':>13}")
    for name in ("prefix cache on", "prefix cache off"):
        r = res[name]
        ratio = r["reuse_median_ms"] / r["first_use_median_ms"]
        print(f"{name:<18}{r['first_use_median_ms']:>11.1f}{r['reuse_median_ms']:>9.1f}"
              f"{r['builtin_median_ms']:>10.1f}{ratio:>13.2f}")  # fmt: skip


# -- LoRA step cost ------------------------------------------------------------------------------


class LoraBench:
    def __init__(self, args: argparse.Namespace, model: Path) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # step() runs on this thread
        own_vllm_sockets()
        from vllm import EngineArgs, LLMEngine
        from vllm.lora.request import LoRARequest

        from llm_worker.engine.args import LORA_CPU_FIX
        from llm_worker.prompt import PromptBuilder
        from testkit.tiny_model import write_random_lora

        self.args = args
        n = args.streams
        base = {
            "model": str(model), "dtype": "float32", "max_model_len": 512, "max_num_seqs": n,
            "kv_cache_memory_bytes": n * 512 * KV_BYTES_PER_TOKEN, "enforce_eager": True,
            "seed": 0, "enable_prefix_caching": False,
        }  # fmt: skip
        lora = {"enable_lora": True, "max_loras": 4, "max_lora_rank": LORA_RANK,
                "worker_extension_cls": LORA_CPU_FIX}  # fmt: skip
        self.engines = {
            v: LLMEngine.from_engine_args(EngineArgs(**base, **({} if v == "no-lora" else lora)))
            for v in LORA_VARIANTS
        }
        self.adapters = [
            LoRARequest(f"a{i}", i + 1, str(write_random_lora(model / "lora" / f"a{i}", i + 1)))
            for i in range(4)
        ]
        builder = PromptBuilder.from_pretrained(str(model))
        self.prompts = builder.build_many("tara", [TEXTS[i % len(TEXTS)] for i in range(n)])
        self._next = 0

    def _lora(self, variant: str, i: int) -> Any:
        if variant == "1 adapter":
            return self.adapters[0]
        if variant == "4 adapters":
            return self.adapters[i % 4]
        return None

    def run(self, tokens: int) -> dict[str, list[float]]:
        from vllm import SamplingParams

        n = self.args.streams
        for v, engine in self.engines.items():
            for i in range(n):
                self._next += 1
                params = SamplingParams(
                    temperature=0.6, top_p=1.0, seed=i, max_tokens=tokens, ignore_eos=True
                )
                engine.add_request(
                    str(self._next),
                    {"prompt_token_ids": self.prompts[i]},
                    params,
                    lora_request=self._lora(v, i),
                )
        cpu = step_in_lockstep(self.engines, tokens)
        return {v: t[1 + self.args.skip :] for v, t in cpu.items()}


def run_lora(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    b = LoraBench(args, model)
    b.run(4)  # warm-up (loads the adapters)
    steps: dict[str, list[float]] = {v: [] for v in LORA_VARIANTS}
    for _ in range(args.rounds):
        for v, t in b.run(args.tokens).items():
            steps[v].extend(t)

    return {
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "rounds": args.rounds,
        "steps_counted": len(steps["no-lora"]),
        "lora_rank": LORA_RANK,
        "max_loras": 4,
        "median_step_ms": {v: statistics.median(t) for v, t in steps.items()},
        "ratio_to_no_lora": {v: paired_median(steps[v], steps["no-lora"]) for v in LORA_VARIANTS},
        "ratio_to_0_adapters": {
            v: paired_median(steps[v], steps["0 adapters"]) for v in LORA_VARIANTS
        },
    }


def print_lora(res: dict[str, Any]) -> None:
    print(f"\nengine step cost, {res['streams']} streams (CPU ms per step, median; lockstep)")
    print(f"{'variant':<12}{'step ms':>9}{'vs no LoRA':>12}{'vs 0 adapters':>15}")
    for v in LORA_VARIANTS:
        print(f"{v:<12}{res['median_step_ms'][v]:>9.1f}{res['ratio_to_no_lora'][v]:>12.2f}"
              f"{res['ratio_to_0_adapters'][v]:>15.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="orpheus-serve bench voices", description=__doc__)
    p.add_argument("--part", choices=["ttfb", "prefill", "lora", "all"], default="all")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--voices", type=int, default=3, help="custom voices (first uses)")
    p.add_argument("--reuses", type=int, default=4, help="requests per voice after its first")
    p.add_argument("--ref-seconds", type=float, default=15.0)
    p.add_argument("--streams", type=int, default=16)
    add_lockstep_arguments(p, tokens=48)
    args = p.parse_args(argv)

    from testkit.tiny_model import write_random_snac, write_tiny_model

    env = environment()
    result: dict[str, Any] = {
        "benchmark": "voices",
        "machine": env["machine"],
        "load_average": os.getloadavg(),
        "commit": env["versions"]["git_commit"],
        "versions": env["versions"],
        "model": "tiny Orpheus-vocabulary Llama (testkit.tiny_model), random weights",
    }
    with tempfile.TemporaryDirectory(prefix="orpheus-bench-voices-") as tmp:
        work = Path(tmp)
        model = work / "model"
        write_tiny_model(model)
        write_random_snac(model / "snac")
        if args.part in ("ttfb", "all"):
            result["ttfb"] = run_ttfb(args, model, work)
            result["ttfb"]["settings"] = {"voices": args.voices, "reuses": args.reuses,
                                          "ref_seconds": args.ref_seconds}  # fmt: skip
            print_ttfb({k: v for k, v in result["ttfb"].items() if k != "settings"})
        if args.part in ("prefill", "all"):
            result["prefill"] = run_prefill(args, model)
            print_prefill(result["prefill"])
        if args.part in ("lora", "all"):
            result["lora"] = run_lora(args, model)
            print_lora(result["lora"])
    result["load_average_after"] = os.getloadavg()
    write_json(result, args.json, announce=sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
