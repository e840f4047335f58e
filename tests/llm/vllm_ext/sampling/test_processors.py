"""The V1 logits processors against straightforward reference computations.

The processors are driven exactly as vLLM's V1 model runner drives them: through vLLM's
own ``InputBatch`` (``add_request``, ``remove_request``, ``condense``, ``swap_states``,
``refresh_metadata``), which builds the ``BatchUpdate`` objects, for random sequences of
joins, finishes, preemptions with later resumption, and row reorders. Between steps the
requests' live output lists grow like the runner's: usually one token, sometimes none
(a chunked-prefill step whose sample is dropped), two, a rewind, or an async-scheduling
placeholder (-1) resolved a step later.
"""

from __future__ import annotations

import inspect
import os
import random
from collections import Counter as Tally
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

from llm_worker.vllm_ext import tokens as T
from llm_worker.vllm_ext.sampling import CounterSlots, PreventedBoard, RequestArgs
from llm_worker.vllm_ext.sampling.constraint import AudioTokenConstraint
from llm_worker.vllm_ext.sampling.penalty import TensorRepetitionPenalty
from llm_worker.vllm_ext.sampling.runner import v2_processors_supported
from shm.records import CODEBOOK_SIZE, FRAME_CODES
from testkit.tiny_model import VOCAB_SIZE, write_tiny_model

MAX_REQS = 12
MAX_LEN = 96


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory: pytest.TempPathFactory) -> VllmConfig:
    model = tmp_path_factory.mktemp("tiny")
    write_tiny_model(model)
    return EngineArgs(
        model=str(model),
        max_model_len=MAX_LEN,
        max_num_seqs=MAX_REQS,
        kv_cache_memory_bytes=1 << 20,
    ).create_engine_config()


@pytest.fixture
def board() -> Iterator[PreventedBoard]:
    b = PreventedBoard.create(f"orpheus-{os.getpid()}-t{os.urandom(3).hex()}-prevented", 64)
    yield b
    b.close()


@dataclass
class Req:
    state: CachedRequestState
    args: RequestArgs | None
    dropped_last: bool = False
    committed: int = 0  # reference count of kept invalid-argmax steps
    pending: int = 0  # this step's flag, committed if the sample is kept
    last_kept: int = 0  # the flag committed by the last kept sample
    len_at_apply: int = 0  # output length when last sampled


@dataclass
class Churn:
    """A V1 persistent batch in vLLM's own InputBatch, changed at random like the runner does."""

    procs: list[LogitsProcessor]
    rng: random.Random
    token_range: tuple[int, int]
    make_args: Callable[[random.Random], RequestArgs | None]
    prompt_end: int | None = T.START_OF_SPEECH
    stop_eos: float = 0.5
    batch: InputBatch = field(init=False)
    running: dict[str, Req] = field(default_factory=dict)
    preempted: dict[str, Req] = field(default_factory=dict)
    finished: list[Req] = field(default_factory=list)
    stats: Tally = field(default_factory=Tally)
    next_id: int = 0

    def __post_init__(self) -> None:
        # vLLM 0.25 also takes the attention kernels' block sizes (0.32 dropped the argument).
        extra = (
            {"kernel_block_sizes": [16]}
            if "kernel_block_sizes" in inspect.signature(InputBatch.__init__).parameters
            else {}
        )
        self.batch = InputBatch(
            **extra,
            max_num_reqs=MAX_REQS,
            max_model_len=MAX_LEN,
            max_num_batched_tokens=MAX_REQS * MAX_LEN,
            device=torch.device("cpu"),
            vocab_size=VOCAB_SIZE,
            block_sizes=[16],
            max_num_blocks_per_req=[MAX_LEN // 16],
            logitsprocs=LogitsProcessors(self.procs),
            logitsprocs_need_output_token_ids=True,
        )

    def _new(self) -> Req:
        rng = self.rng
        prompt = [rng.randrange(*self.token_range) for _ in range(rng.randrange(1, 20))]
        if self.prompt_end is not None:
            prompt.append(self.prompt_end)
        args = self.make_args(rng)
        stops = [T.END_OF_SPEECH] if rng.random() < self.stop_eos else []
        params = SamplingParams(
            temperature=1.0,
            max_tokens=MAX_LEN,
            stop_token_ids=stops,
            ignore_eos=not stops,
            extra_args=args.to_extra_args() if args else None,
        )
        self.next_id += 1
        state = CachedRequestState(
            req_id=f"r{self.next_id}",
            prompt_token_ids=prompt,
            mm_features=[],
            sampling_params=params,
            generator=None,
            block_ids=([0],),
            num_computed_tokens=0,
            output_token_ids=[],
        )
        return Req(state, args)

    def change(self) -> None:
        """One step's batch changes, in the runner's order."""
        rng, batch = self.rng, self.batch
        for rid in list(self.running):
            req = self.running[rid]
            full = len(req.state.prompt_token_ids) + len(req.state.output_token_ids) >= MAX_LEN - 3
            if req.dropped_last:
                continue  # a chunked prefill continues next step
            if full or rng.random() < 0.12:
                del self.running[rid]
                self.finished.append(req)
                batch.remove_request(rid)
            elif rng.random() < 0.08:
                del self.running[rid]
                self.preempted[rid] = req
                batch.remove_request(rid)
                self.stats["preempted"] += 1
            elif (out := req.state.output_token_ids) and out[-1] != -1 and rng.random() < 0.03:
                # A KV-load failure discards tokens. A sample counts as dropped if the
                # list is no longer than when it was sampled.
                del out[-rng.randrange(1, 3) :]
                if len(out) <= req.len_at_apply:
                    req.committed -= req.last_kept
                    req.last_kept = 0
                self.stats["rewound"] += 1
        joining: list[Req] = []
        for rid in list(self.preempted):
            if rng.random() < 0.4 and len(self.running) + len(joining) < MAX_REQS:
                joining.append(self.preempted.pop(rid))
                self.stats["resumed"] += 1
        while len(self.running) + len(joining) < MAX_REQS and rng.random() < 0.6:
            joining.append(self._new())
        for req in joining:
            self.running[req.state.req_id] = req
            batch.add_request(req.state)
        batch.condense()
        for _ in range(rng.randrange(3)):
            if batch.num_reqs >= 2:
                i, j = rng.sample(range(batch.num_reqs), 2)
                batch.swap_states(i, j)
        self.stats["moved"] += len(batch.batch_update_builder.moved)
        batch.refresh_metadata()

    def rows(self) -> list[Req]:
        return [self.running[rid] for rid in self.batch.req_ids]

    def sample(self, pick: Callable[[Req], int]) -> None:
        """Grow the output lists like the runner; ``pick(req) -> token`` for kept samples."""
        rng = self.rng
        for req in self.rows():
            out = req.state.output_token_ids
            if out and out[-1] == -1:
                out[-1] = pick(req)  # the async placeholder resolves
            r = rng.random()
            req.dropped_last = r < 0.05
            req.last_kept = 0 if req.dropped_last else req.pending
            req.committed += req.last_kept
            req.pending = 0  # kept: committed; dropped: retracted at the next step
            if req.dropped_last:
                continue
            if r < 0.08:
                out.extend((pick(req), pick(req)))
            elif r < 0.11:
                out.append(-1)
            else:
                out.append(pick(req))


def reference_penalty(logits: torch.Tensor, rows: list[Req]) -> torch.Tensor:
    """The definition, row by row: seen tokens are divided (> 0) or multiplied by p."""
    expected = logits.clone()
    for i, req in enumerate(rows):
        p = req.args.repetition_penalty if req.args else 1.0
        if p == 1.0:
            continue
        seen = set(req.state.prompt_token_ids) | set(req.state.output_token_ids)
        seen.discard(-1)
        idx = torch.tensor(sorted(seen))
        x = expected[i, idx]
        pen = torch.tensor(p, dtype=torch.float32)
        expected[i, idx] = torch.where(x > 0, x * (1.0 / pen), x * pen)
    return expected


def upstream_penalty(logits: torch.Tensor, rows: list[Req]) -> torch.Tensor:
    """vLLM's own V1 path on the same batch (penalties from padded lists)."""
    vocab = logits.shape[1]
    width = max(len(r.state.prompt_token_ids) for r in rows)
    prompts = torch.full((len(rows), width), vocab, dtype=torch.int64)
    for i, r in enumerate(rows):
        prompts[i, : len(r.state.prompt_token_ids)] = torch.tensor(r.state.prompt_token_ids)
    pen = torch.tensor([r.args.repetition_penalty if r.args else 1.0 for r in rows])
    zeros = torch.zeros(len(rows))
    outs = [list(r.state.output_token_ids) for r in rows]
    return apply_all_penalties(logits.clone(), prompts, zeros, zeros, pen, outs)


def penalty_args(rng: random.Random) -> RequestArgs | None:
    r = rng.random()
    if r < 0.2:
        return None
    if r < 0.3:
        return RequestArgs(constrain_audio=True)  # ours, but no penalty
    return RequestArgs(repetition_penalty=rng.choice([1.1, 1.3, 0.7, 2.0]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalty_equals_reference_through_batch_churn(vllm_config: VllmConfig, seed: int) -> None:
    rng = random.Random(seed)
    proc = TensorRepetitionPenalty(vllm_config, torch.device("cpu"), False)
    vocab = 600  # a small vocabulary makes repeats, and so penalties, frequent
    churn = Churn([proc], rng, (0, vocab), penalty_args, prompt_end=None)
    gen = torch.Generator().manual_seed(seed)
    penalised_rows = 0
    for _ in range(80):
        churn.change()
        rows = churn.rows()
        if not rows:
            continue
        logits = torch.randn(len(rows), vocab, generator=gen) * 3
        logits[:, ::7] = 0.0  # exact zeros take the multiply branch
        got = proc.apply(logits.clone())
        assert torch.equal(got, reference_penalty(logits, rows))
        assert torch.equal(got, upstream_penalty(logits, rows))
        penalised_rows += sum(bool(r.args and r.args.penalised) for r in rows)
        churn.sample(lambda req: rng.randrange(vocab))
    assert penalised_rows > 100
    assert churn.stats["moved"] > 10 and churn.stats["resumed"] > 3 and churn.stats["rewound"]


def constraint_args(board: str) -> Callable[[random.Random], RequestArgs | None]:
    def make(rng: random.Random) -> RequestArgs | None:
        r = rng.random()
        if r < 0.15:
            return None
        if r < 0.25:
            return RequestArgs(repetition_penalty=1.2)  # ours, but not constrained
        if r < 0.35:  # constrained, no per-stream slot: counted in the board's sink
            return RequestArgs(constrain_audio=True, board=board, slot=0)
        return RequestArgs(constrain_audio=True, board=board, slot=rng.randrange(1, 65))

    return make


def allowed_mask(rows: list[Req]) -> torch.Tensor:
    """``[rows, vocab]``: the tokens each constrained row may sample."""
    ok = torch.zeros(len(rows), VOCAB_SIZE, dtype=torch.bool)
    for i, req in enumerate(rows):
        slot = len(req.state.output_token_ids) % FRAME_CODES
        lo = T.AUDIO_TOKEN_BASE + slot * CODEBOOK_SIZE
        ok[i, lo : lo + CODEBOOK_SIZE] = True
        if slot == 0 and T.END_OF_SPEECH in req.state.sampling_params.stop_token_ids:
            ok[i, T.END_OF_SPEECH] = True
    return ok


@pytest.mark.parametrize("seed", [0, 1])
def test_constraint_masks_and_counts_through_batch_churn(
    vllm_config: VllmConfig, board: PreventedBoard, seed: int
) -> None:
    rng = random.Random(seed)
    proc = AudioTokenConstraint(vllm_config, torch.device("cpu"), False)
    churn = Churn([proc], rng, (0, 128000), constraint_args(board.name))
    gen = torch.Generator().manual_seed(seed)
    constrained_steps = invalid_steps = 0
    for _ in range(50):
        churn.change()
        rows = churn.rows()
        if not rows:
            continue
        logits = torch.randn(len(rows), VOCAB_SIZE, generator=gen)
        # Sometimes favour an audio token; sometimes min_tokens has masked end-of-speech.
        for i in range(len(rows)):
            if rng.random() < 0.3:
                logits[i, T.AUDIO_TOKEN_BASE + rng.randrange(7 * CODEBOOK_SIZE)] = 9.0
            if rng.random() < 0.2:
                logits[i, T.END_OF_SPEECH] = float("-inf")
            elif rng.random() < 0.2:
                logits[i, T.END_OF_SPEECH] = 10.0
        got = proc.apply(logits.clone())

        on = torch.tensor([bool(r.args and r.args.constrain_audio) for r in rows])
        ok = allowed_mask(rows)
        assert torch.equal(got[~on], logits[~on])
        ok_on, got_on, logits_on = ok[on], got[on], logits[on]
        assert torch.equal(got_on[ok_on], logits_on[ok_on])
        assert torch.isneginf(got_on[~ok_on]).all()
        neg = float("-inf")
        invalid = logits.masked_fill(ok, neg).amax(1) > logits.masked_fill(~ok, neg).amax(1)
        for req, flag, constrained in zip(rows, invalid.tolist(), on.tolist(), strict=True):
            req.pending = int(flag and constrained)
            req.len_at_apply = len(req.state.output_token_ids)
        constrained_steps += int(on.sum())
        invalid_steps += int((invalid & on).sum())

        # The board holds every kept step's count plus this step's (not yet known dropped).
        expected = [0] * (board.slots + 1)
        for req in [*churn.running.values(), *churn.preempted.values(), *churn.finished]:
            if req.args and req.args.constrain_audio:
                expected[req.args.slot] += req.committed + req.pending
        assert board.counts.tolist() == expected

        def pick(req: Req) -> int:
            slot = len(req.state.output_token_ids) % FRAME_CODES
            return T.AUDIO_TOKEN_BASE + slot * CODEBOOK_SIZE + rng.randrange(CODEBOOK_SIZE)

        churn.sample(pick)
    assert constrained_steps > 200 and 0 < invalid_steps < constrained_steps
    assert churn.stats["moved"] > 10 and churn.stats["resumed"] > 3 and churn.stats["rewound"]


def test_board_round_trip(tmp_path: Path) -> None:
    name = f"orpheus-{os.getpid()}-t{os.urandom(3).hex()}-prevented"
    board = PreventedBoard.create(name, 3)
    try:
        slots = CounterSlots(board)
        a, b, c = slots.acquire(), slots.acquire(), slots.acquire()
        assert slots.acquire() is None
        engine_side = PreventedBoard.attach(name)
        engine_side.counts[a.slot] += 5
        engine_side.counts[0] += 2
        assert slots.release(a) == 5 and slots.count(b) == 0
        again = slots.acquire()
        assert again.slot == a.slot and slots.count(again) == 0  # baseline taken at acquire
        assert board.total() == 7
        engine_side.close()
        del c
    finally:
        board.close()
    assert not os.path.exists(f"/dev/shm/{name}")


@dataclass
class HostBacked:
    """The ``.np`` / ``.gpu`` pair of vLLM's ``UvaBackedTensor``, on the CPU.

    vLLM's own class needs pinned memory, which a machine without an accelerator lacks.
    """

    np: object
    gpu: torch.Tensor

    @classmethod
    def of(cls, values: list[int]) -> HostBacked:
        t = torch.tensor(values, dtype=torch.int32)
        return cls(t.numpy(), t)


@pytest.mark.skipif(
    not v2_processors_supported(), reason="this vLLM has no V2 logits-processor interface (0.25)"
)
def test_v2_constraint_masks_and_counts_kept_rows(
    vllm_config: VllmConfig, board: PreventedBoard
) -> None:
    """The V2 processor on V2's per-slot state: positions from ``pos``, no host bookkeeping."""
    from vllm.v1.worker.gpu.sample.logits_processor.interface import (
        LogitsContext,
        LogitsProcRequestState,
    )

    from llm_worker.vllm_ext.sampling.constraint_v2 import AudioTokenConstraintV2

    n = vllm_config.scheduler_config.max_num_seqs
    prompt_len = [0] * n
    prefill_len = [0] * n
    # slot 2: fresh request, prompt of 10; slot 5: resumed with 9 outputs (refill of 29);
    # slot 7: in a chunked prefill (its sample is dropped); slot 1: not constrained.
    prompt_len[2], prefill_len[2] = 10, 10
    prompt_len[5], prefill_len[5] = 20, 29
    prompt_len[7], prefill_len[7] = 30, 30
    prompt_len[1], prefill_len[1] = 5, 5
    req_states = LogitsProcRequestState(
        device=torch.device("cpu"),
        max_num_reqs=n,
        vocab_size=VOCAB_SIZE,
        all_token_ids=None,
        prompt_len=HostBacked.of(prompt_len),
        prefill_len=HostBacked.of(prefill_len),
        total_len=None,
    )
    proc = AudioTokenConstraintV2(vllm_config, req_states)

    def params(constrain: bool, stops: bool) -> SamplingParams:
        args = RequestArgs(constrain_audio=constrain, board=board.name, slot=3 if stops else 4)
        return SamplingParams(
            stop_token_ids=[T.END_OF_SPEECH] if stops else [],
            ignore_eos=not stops,
            extra_args=args.to_extra_args(),
        )

    assert proc.add_request(2, params(True, True))
    assert proc.add_request(5, params(True, False))
    assert proc.add_request(7, params(True, True))
    assert not proc.add_request(1, params(False, True))

    slots_of_rows = [5, 2, 7, 1]
    # Input positions: the sampled token is at pos + 1.
    pos = [29 - 1 + 5, 10 - 1 + 14, 12, 40]  # audio positions 14 (slot 0), 14 (slot 0)
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    logits[:, T.END_OF_SPEECH] = 20.0  # wants to stop: allowed only where it is a stop
    ctx = LogitsContext(
        expanded_idx_mapping=torch.tensor(slots_of_rows, dtype=torch.int32),
        idx_mapping=torch.tensor(slots_of_rows, dtype=torch.int32),
        idx_mapping_np=torch.tensor(slots_of_rows).numpy(),
        expanded_local_pos=torch.zeros(4, dtype=torch.int32),
        input_ids=torch.zeros(4, dtype=torch.int32),
        pos=torch.tensor(pos, dtype=torch.int64),
        seq_lens_upper_bound_np=(torch.tensor(pos) + 1).numpy(),
    )
    got = proc.apply(logits.clone(), ctx)

    lo = T.AUDIO_TOKEN_BASE  # audio position 14 is slot 0
    for row in (0, 1):
        finite = torch.isfinite(got[row]).nonzero().flatten().tolist()
        window = list(range(lo, lo + CODEBOOK_SIZE))
        # slot 5's request ignores end-of-speech: not allowed; slot 2's stops on it.
        assert finite == (window if row == 0 else sorted([T.END_OF_SPEECH, *window]))
    assert torch.equal(got[3], logits[3])  # not constrained
    # Row 0 wanted end-of-speech, not allowed: counted on slot 4. Row 1 got it: valid.
    # Row 2 (chunked prefill) wanted it off a boundary but its sample is dropped: uncounted.
    assert board.counts[4] == 1 and board.counts[3] == 0 and board.total() == 1
