"""The engine's warm-up before the worker reports ready: the batch shapes traffic will hit.

The first batch of a kind pays for whatever is compiled or allocated on first use. The one
that hurt on the H100 is the top-p/top-k sampler: vLLM switches implementation by the
number of rows (0.25: PyTorch's sort below 8 rows, a Triton kernel from 8; 0.32: on CUDA a
split-row Triton pipeline up to 64 rows with top-p alone, the one-program-per-row kernel
above), and a Triton kernel compiles on its first call, for the specialisations its integer
arguments select. vLLM's own start-up dummy run samples one small batch without top-p, so a
server's first wave of 8 or more streams stalled for seconds while its users waited.

So before ready, :func:`warm_up` runs ``WARMUP_ROWS`` (at most ``max_num_seqs``) requests
at once, built as the service builds a segment (a :class:`~llm_worker.requests.RequestPlan`
of the configured voices' sampling, :func:`llm_worker.requests.segment_params` with the
sampling package's arguments and the engine's end-of-speech id), with lengths ``rows,
rows - 1, ..., 1``: the batch shrinks by one row per step, so every batch size from ``rows``
down to 1 is sampled once, on both sides of every threshold. They go in through the engine's
one entry (:meth:`llm_worker.engine.engine.GenerationEngine.add`, which converts the prompt to the
output head's ids), so the output head, processors and runner are the ones in use.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Protocol

import msgspec

from common.config.llm import LLMConfig, VoiceSampling
from llm_worker.requests import RequestPlan, segment_params

if TYPE_CHECKING:
    from vllm import SamplingParams

    from llm_worker.prompt import PromptBuilder
    from llm_worker.vllm_ext.sampling.hooks import SamplingHooks
    from llm_worker.vllm_ext.token_space import TokenSpace


class Engine(Protocol):
    """:class:`llm_worker.engine.engine.GenerationEngine`, as the warm-up uses it."""

    space: TokenSpace

    async def run(self, request_id: str, prompt: list[int], params: SamplingParams) -> int: ...


WARMUP_ROWS = 72
"""Concurrent warm-up requests: above every row threshold of vLLM's top-p/top-k sampler
(8 in 0.25, 64 in 0.32; see the module docstring)."""


class WarmUp(msgspec.Struct, frozen=True):
    rows: int
    """The largest batch sampled (every smaller one was too)."""
    samplings: int
    """Distinct sampling settings (the voices') the rows were spread over."""
    seconds: float

    def describe(self) -> str:
        return (
            f"warm-up {self.rows} rows (batches {self.rows}..1, {self.samplings} sampling "
            f"setting{'s' if self.samplings != 1 else ''}) {self.seconds:.1f}s"
        )


def warmup_samplings(config: LLMConfig) -> list[VoiceSampling]:
    """The default voice's sampling first, then every other voice's distinct one."""
    first = config.voice_sampling.get(config.default_voice, config.sampling)
    out = [first]
    for vs in (config.sampling, *config.voice_sampling.values()):
        if vs not in out:
            out.append(vs)
    return out


def warmup_lengths(rows: int) -> list[int]:
    """Tokens of each warm-up request, in submission order: ``rows`` down to 1."""
    return list(range(rows, 0, -1))


async def warm_up(
    engine: Engine, prompts: PromptBuilder, config: LLMConfig, hooks: SamplingHooks
) -> WarmUp:
    """Run the warm-up batch through ``engine`` to its end (``hooks``: the sampling
    package's per-request arguments, as the service's)."""
    t0 = time.monotonic()
    rows = max(1, min(WARMUP_ROWS, config.max_num_seqs))
    kinds = warmup_samplings(config)
    voice = config.default_voice

    async def one(i: int, tokens: int) -> None:
        vs = kinds[i % len(kinds)]
        text = f"Warming up, row {i}."
        prompt = prompts.build(voice, text)
        plan = RequestPlan(voice=voice, kind="model", sampling=vs, seed=i, total_tokens=tokens)
        params = segment_params(
            config, plan, 0, len(text), len(prompt), tokens,
            hooks.kwargs(vs, None), engine.space.end_of_speech,
        )  # fmt: skip
        await engine.run(f"warmup-{i}", prompt, params)

    await asyncio.gather(*(one(i, n) for i, n in enumerate(warmup_lengths(rows))))
    return WarmUp(rows=rows, samplings=len(kinds), seconds=time.monotonic() - t0)
