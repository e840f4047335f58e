"""``orpheus-serve bench penalties [--json FILE]``: engine step time with each sampling path.

Variants, each on the same prompts and seeds (tiny Orpheus model, CPU build):

- ``none``: repetition penalty 1.0, no constraint (the baseline);
- ``upstream``: repetition penalty 1.1 through vLLM's own (list-based, V1) path;
- ``ours``: repetition penalty 1.1 through :class:`~llm_worker.vllm_ext.sampling.penalty.TensorRepetitionPenalty`;
- ``constraint``: no penalty, the audio-token constraint with prevented-token counting on.

Each variant has its own in-process vLLM engine (identical configuration, our processors
registered in all, so the variants differ only in their requests' sampling arguments),
and the engines are stepped in lockstep: one decode step of each variant, in an order
rotated every step, then the next. Alternating at step granularity puts every variant
under the same load from the machine's other tenants, which on a shared machine moves a
single run's time by ±20% within minutes.

A batch is ``streams`` requests decoding ``--tokens`` tokens each (ignore_eos). A step's
cost is the process CPU time of ``LLMEngine.step()`` (schedule, forward, sample, output
processing; in the CPU build all of it runs on this process's CPU). Steps after the
``--skip`` first decode steps count. Reported per variant: the median step, and the
median over lockstep cycles of the paired ratio to ``none`` (each ratio compares steps
taken back to back). The sampler defaults to temperature 0.6 with top_p 1.0: the CPU
build's top-p sorts the whole vocabulary, a cost the GPU sampler does not have, which
would hide the penalty's cost (``--top-p 0.8`` runs the voices' default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.report import environment, show, table, write_json
from bench.lib.stats import percentile
from bench.llm.lockstep import (
    KV_BYTES_PER_TOKEN,
    TEXTS,
    add_lockstep_arguments,
    paired_median,
    step_in_lockstep,
)

STREAMS = (1, 16, 64)
VARIANTS = ("none", "upstream", "ours", "constraint")


class Bench:
    def __init__(self, args: argparse.Namespace, model: str) -> None:
        # In-process engine cores: step() runs one whole engine step on this thread.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import EngineArgs, LLMEngine

        from common.config.llm import LLMConfig
        from llm_worker.engine.env import own_vllm_sockets
        from llm_worker.prompt import PromptBuilder
        from llm_worker.vllm_ext.sampling import (
            ModelRunner,
            PreventedBoard,
            SamplingPlan,
            pin_model_runner,
            prepare_sampler_environment,
        )

        self.args = args
        self.board = PreventedBoard.create(f"orpheus-{os.getpid()}-bench-prevented", 1)
        # The variants compared here are V1's (vLLM's list penalty vs ours).
        pin_model_runner(ModelRunner.V1)
        prepare_sampler_environment()
        own_vllm_sockets()
        self.plan = SamplingPlan.for_config(LLMConfig(), ModelRunner.V1, board=self.board.name)
        n = max(args.streams)
        engine_args = EngineArgs(
            model=model,
            dtype=args.dtype,
            max_model_len=512,
            max_num_seqs=n,
            kv_cache_memory_bytes=n * 512 * KV_BYTES_PER_TOKEN,
            enforce_eager=True,
            seed=0,
            logits_processors=self.plan.logits_processors(),
        )
        self.engines = {v: LLMEngine.from_engine_args(engine_args) for v in VARIANTS}
        builder = PromptBuilder.from_pretrained(model)
        self.prompts = builder.build_many("tara", [TEXTS[i % len(TEXTS)] for i in range(256)])
        self._next_id = 0

    def params(self, variant: str, i: int, tokens: int) -> Any:
        from vllm import SamplingParams

        p = self.args.penalty
        kw: dict[str, Any]
        if variant == "none":
            kw = {}
        elif variant == "upstream":
            kw = {"repetition_penalty": p}
        elif variant == "ours":
            kw = self.plan.request_kwargs(repetition_penalty=p, constrain=False)
        else:
            # No stop token: end-of-speech is never allowed, every stream runs full length.
            kw = self.plan.request_kwargs(repetition_penalty=1.0)
        return SamplingParams(
            temperature=self.args.temperature,
            top_p=self.args.top_p,
            seed=i,
            max_tokens=tokens,
            ignore_eos=True,
            **kw,
        )

    def run(self, streams: int, tokens: int) -> dict[str, list[float]]:
        """One batch per variant, stepped in lockstep: CPU ms of each counted step."""
        for v, engine in self.engines.items():
            for i in range(streams):
                self._next_id += 1
                prompt = {"prompt_token_ids": self.prompts[i % len(self.prompts)]}
                engine.add_request(str(self._next_id), prompt, self.params(v, i, tokens))
        cpu = step_in_lockstep(self.engines, tokens)  # the prefill step samples the first token
        first = min(1 + self.args.skip, tokens - 1)
        return {v: times[first:] for v, times in cpu.items()}

    def close(self) -> None:
        self.board.close()


def bench(args: argparse.Namespace, model: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    b = Bench(args, model)
    try:
        for n in args.streams:  # warm-up: one short batch per level, not counted
            b.run(n, 4)
        steps: dict[int, dict[str, list[float]]] = {
            n: {v: [] for v in VARIANTS} for n in args.streams
        }
        for _ in range(args.rounds):
            for n in args.streams:
                for v, times in b.run(n, args.tokens).items():
                    steps[n][v].extend(times)
        config = {
            "model": "tiny Orpheus-vocabulary Llama (testkit.tiny_model), random weights",
            "runner": b.plan.runner.value,
            "sampling": b.plan.describe(),
            "dtype": args.dtype,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "repetition_penalty": args.penalty,
            "tokens_per_stream": args.tokens,
            "skipped_steps": args.skip,
            "rounds": args.rounds,
            "prompt_tokens": [len(p) for p in b.prompts[:8]],
            "step_time": "process CPU ms of LLMEngine.step(); variants stepped in lockstep",
            "prevented_tokens_in_constraint_runs": b.board.total(),
        }
    finally:
        b.close()
    results = []
    for n in args.streams:
        s = steps[n]
        med = {v: statistics.median(s[v]) for v in VARIANTS}
        paired = {v: paired_median(s[v], s["none"]) for v in VARIANTS[1:]}
        results.append(
            {
                "streams": n,
                "steps_counted": len(s["none"]),
                "step_ms_no_penalty": med["none"],
                "step_ms_upstream_penalty": med["upstream"],
                "step_ms_our_penalty": med["ours"],
                "upstream_penalty_overhead_ratio": paired["upstream"],
                "our_penalty_overhead_ratio": paired["ours"],
                "step_ms_no_constraint": med["none"],
                "step_ms_constraint": med["constraint"],
                "constraint_overhead_ratio": paired["constraint"],
                "step_ms_p90": {v: percentile(s[v], 90) for v in VARIANTS},
            }
        )
    return results, config


def _print_table(results: list[dict[str, Any]]) -> None:
    columns = ("streams", "none", "upstream", "ours", "upstream/none", "ours/none",
               "constraint", "constraint/none")  # fmt: skip
    rows = [
        (
            str(r["streams"]),
            f"{r['step_ms_no_penalty']:.1f}",
            f"{r['step_ms_upstream_penalty']:.1f}",
            f"{r['step_ms_our_penalty']:.1f}",
            f"{r['upstream_penalty_overhead_ratio']:.3f}",
            f"{r['our_penalty_overhead_ratio']:.3f}",
            f"{r['step_ms_constraint']:.1f}",
            f"{r['constraint_overhead_ratio']:.3f}",
        )
        for r in results
    ]
    title = "engine step, CPU ms (median), and paired ratio to no penalty"
    show(table(title, columns, rows, no_wrap=True), min_width=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="orpheus-serve bench penalties", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--model", help="model directory (default: the tiny model, written to a temp dir)"
    )
    p.add_argument("--streams", type=int, nargs="+", default=list(STREAMS))
    add_lockstep_arguments(p, tokens=32)
    p.add_argument("--penalty", type=float, default=1.1)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", help="float32 is faster than bf16 without AVX-512")
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="orpheus-bench-") as tmp:
        model = args.model
        if model is None:
            from testkit.tiny_model import write_tiny_model

            write_tiny_model(Path(tmp))
            model = tmp
        results, config = bench(args, model)

    _print_table(results)
    top = max(results, key=lambda r: r["streams"])
    print(
        f"ours over no penalty at {top['streams']} streams: "
        f"{top['our_penalty_overhead_ratio']:.3f} (target <= 1.10); "
        f"upstream: {top['upstream_penalty_overhead_ratio']:.3f}"
    )
    if args.json:
        doc = {
            "benchmark": "penalties",
            **environment(),
            "config": config,
            "our_penalty_overhead_ratio": top["our_penalty_overhead_ratio"],
            "upstream_penalty_overhead_ratio": top["upstream_penalty_overhead_ratio"],
            "constraint_overhead_ratio": top["constraint_overhead_ratio"],
            "results": results,
        }
        write_json(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
