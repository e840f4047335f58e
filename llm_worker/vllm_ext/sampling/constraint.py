"""The audio-token constraint as a logits processor for vLLM's V1 (legacy) model runner.

A constrained request's prompt ends with start-of-speech, so its audio position is its
number of output tokens: the position of the token being sampled is ``len(outputs)``.
Each step the processor reads every row's output count in one C-level pass, derives the
slot, and constrains the whole batch with :class:`~llm_worker.vllm_ext.sampling.audio_mask.AudioSlotMask`.

What it counts, once a request names a counter board: the **kept sampling steps at
which the unconstrained argmax was invalid**, i.e. some token outside the allowed set
scored strictly higher than every allowed one, judged on the logits as they reach this
processor (after min_tokens, logit_bias and the tensor repetition penalty, before
temperature). A step's sample is *kept* if the request's output list has grown when
the request is next sampled; vLLM throws away the samples of a chunked prefill's partial
steps (and tokens after a KV-load failure), and their counts are retracted then. The
last sample of a finished request is always kept.

Composes with min_tokens (end-of-speech keeps the -inf min_tokens gave it) and with
ignore_eos: end-of-speech is allowed only when it is one of the request's stop tokens,
so a request that must run on never receives a non-audio token that would shift the
slots of everything after it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from llm_worker.vllm_ext.sampling.args import RequestArgs
from llm_worker.vllm_ext.sampling.audio_mask import AudioSlotMask
from llm_worker.vllm_ext.sampling.counters import SINK, DeviceTally
from llm_worker.vllm_ext.sampling.rows import RowTracker
from llm_worker.vllm_ext.sampling.staging import Staged
from llm_worker.vllm_ext.token_space import TokenSpace, engine_token_space
from shm.records import FRAME_CODES

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


def end_of_speech_stops(params: SamplingParams, space: TokenSpace) -> bool:
    """Whether sampling end-of-speech ends this request (so it may be allowed at all)."""
    eos = space.end_of_speech
    return eos in (params.stop_token_ids or ()) or (
        params.eos_token_id == eos and not params.ignore_eos
    )


def counter_index(args: RequestArgs, tally: DeviceTally) -> int:
    """The board counter a request's counts go to (attaching the board on first sight)."""
    if args.board is None:
        return SINK
    if not tally.attach(args.board):
        log.warning("request names board %s, another is attached: counted in its sink", args.board)
        return SINK
    if not tally.attached:
        return SINK  # a tensor-parallel rank that does not count
    if args.slot > tally.slots:
        log.warning("counter slot %d beyond the board's %d: in the sink", args.slot, tally.slots)
        return SINK
    return args.slot


class AudioTokenConstraint(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        RequestArgs.of(sampling_params)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        n = vllm_config.scheduler_config.max_num_seqs
        self.device = torch.device(device)
        self.rows = RowTracker(n)
        self.eos_stops = Staged(n, torch.bool, self.device)
        self.counter = Staged(n, torch.int64, self.device)
        self.constrained = Staged(n, torch.bool, self.device)
        self.ingested = np.zeros(n, dtype=np.int64)
        """Each row's output count when it was last sampled."""
        self.sampled = np.zeros(n, dtype=bool)
        """The row has been sampled since it joined (so it may have a flag to retract)."""
        self.counted_last = torch.zeros(n, dtype=torch.bool, device=self.device)
        """Each row's flag from its last sampling step, retracted if that sample is dropped."""
        self.rows.track(
            self.eos_stops.np, self.counter.np, self.ingested, self.sampled, self.counted_last
        )
        self.slot = Staged(n, torch.int64, self.device)
        self.space = engine_token_space(vllm_config)
        self.mask = AudioSlotMask(n, self.device, self.space)
        self.tally = DeviceTally(self.device)
        self._lens = np.zeros(n, dtype=np.int64)
        self._any = False
        self._all = False
        self._eos_dev = self.eos_stops.dev[:0]
        self._counter_dev = self.counter.dev[:0]
        self._constrained_dev = self.constrained.dev[:0]

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not self.rows.update(batch_update, self._add):
            return
        b = self.rows.batch_size
        active = self.rows.active[:b]
        self._any = bool(active.any())
        self._all = bool(active.all())
        self.constrained.np[:b] = active
        self._constrained_dev = self.constrained.upload(b)
        self._eos_dev = self.eos_stops.upload(b)
        self._counter_dev = self.counter.upload(b)

    def _add(
        self, row: int, params: SamplingParams, prompt: list[int] | None, out: list[int]
    ) -> bool:
        args = RequestArgs.of(params)
        self.ingested[row] = len(out)
        self.sampled[row] = False
        if args is None or not args.constrain_audio:
            self.eos_stops.np[row] = False
            self.counter.np[row] = SINK
            return False
        if not prompt or prompt[-1] != self.space.start_of_speech:
            # Raising here would fail the whole engine step: leave this request alone.
            log.error("constrained request's prompt does not end with start-of-speech: ignored")
            self.eos_stops.np[row] = False
            self.counter.np[row] = SINK
            return False
        self.eos_stops.np[row] = end_of_speech_stops(params, self.space)
        self.counter.np[row] = counter_index(args, self.tally)
        return True

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._any:
            return logits
        b = logits.shape[0]
        if b != self.rows.batch_size:
            raise RuntimeError(f"logits have {b} rows, the batch {self.rows.batch_size}")
        lens = self.rows.output_lengths(self._lens)
        count = self.tally.attached
        if count:
            self._retract_dropped(lens)
        self.ingested[:b] = lens
        self.sampled[:b] = True
        np.remainder(lens, FRAME_CODES, out=self.slot.np[:b])
        invalid = self.mask.apply_(
            logits,
            self.slot.upload(b),
            self._eos_dev,
            None if self._all else self._constrained_dev,
            count,
        )
        if invalid is not None:
            self.counted_last[:b] = invalid
            self.tally.add(self._counter_dev, invalid)
            self.tally.publish()
        return logits

    def _retract_dropped(self, lens: np.ndarray) -> None:
        """Uncount last step's flags of rows whose sample vLLM threw away.

        A row's output list that has not grown since it was last sampled lost that sample:
        a chunked prefill's partial step, or tokens discarded after a KV-load failure.
        """
        b = len(lens)
        not_grown = lens <= self.ingested[:b]
        dropped = np.flatnonzero(self.rows.active[:b] & self.sampled[:b] & not_grown)
        if len(dropped) == 0:
            return
        rows = torch.from_numpy(dropped).to(self.device)
        self.tally.add(self.counter.dev[rows], self.counted_last[rows], sign=-1)
        self.counted_last[rows] = False
