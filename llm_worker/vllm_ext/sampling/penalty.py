"""Repetition penalty with its state in preallocated tensors (vLLM V1 runner).

vLLM's V1 sampler, for any batch with a penalty, rebuilds every request's output tokens
from Python lists into a padded tensor (``make_tensor_with_pad``), then allocates two
``[batch, vocab + 1]`` int64 count tensors and several ``[batch, vocab]`` masks, every
step. This processor keeps instead, per batch row, the row's token history (prompt, then
outputs) in a preallocated ``[max_num_seqs, max_model_len]`` tensor, appends each step's
sampled token with one ``index_put_``, and penalises with a gather/scatter over
``[batch, longest history]``: the cost follows the tokens seen, not the vocabulary
(156,940 for Orpheus; a history is a few hundred to a few thousand tokens).

Semantics are vLLM's exactly: a token seen in the prompt or the output has its logit
divided by the penalty if positive, multiplied by it otherwise, with the same float
arithmetic as vLLM on the same device (the CPU path multiplies by the float32
reciprocal, the CUDA kernel divides), so outputs are bit-identical for the same seed.

A token repeated in the history appears several times in the gather index. That is
harmless: every copy reads the same original logit and writes back the same result.
Columns past a row's history hold the row's first prompt token, a token the row has
already seen, so the padding is harmless too. Rows the penalty does not apply to get a
penalty of 1.0, an exact no-op.

With the audio output head (:mod:`llm_worker.engine.output_head`) the logits are narrower than
the vocabulary: prompt ids past their width (text) can never be sampled and have no column
to penalise, so they are written into the history as the prompt's first id inside the
width (an id the row has seen, like the padding).

Requests opt in through ``extra_args`` (:mod:`llm_worker.vllm_ext.sampling.args`) and run with
vLLM's own ``repetition_penalty=1.0``, so vLLM skips its list path.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from llm_worker.vllm_ext.sampling.args import RequestArgs
from llm_worker.vllm_ext.sampling.rows import RowTracker
from llm_worker.vllm_ext.sampling.staging import Staged
from llm_worker.vllm_ext.token_space import engine_token_space

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)


class TensorRepetitionPenalty(LogitsProcessor):
    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        RequestArgs.of(sampling_params)

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool):
        n = vllm_config.scheduler_config.max_num_seqs
        m = vllm_config.model_config.max_model_len
        self.device = torch.device(device)
        self.width = engine_token_space(vllm_config).width
        """Logits columns: prompt ids at or past it have no logit (the audio head)."""
        # The CUDA kernel divides positive logits; the CPU path multiplies by 1/penalty.
        self._divide = self.device.type == "cuda"
        self.rows = RowTracker(n)
        self.history = torch.zeros((n, m), dtype=torch.int64, device=self.device)
        """Row r: prompt, outputs, then the first prompt token up to max_model_len."""
        self.prompt_len = np.zeros(n, dtype=np.int64)
        self.seq_len = np.zeros(n, dtype=np.int64)
        """Tokens of the row's history written so far (prompt + ingested outputs)."""
        self.ingested = np.zeros(n, dtype=np.int64)
        """Output tokens already in the history (the runner's list may be longer)."""
        self.penalty = Staged(n, torch.float32, self.device)
        self.recip = Staged(n, torch.float32, self.device)
        self.penalty.np[:] = 1.0
        self.recip.np[:] = 1.0
        self.rows.track(
            self.history,
            self.prompt_len,
            self.seq_len,
            self.ingested,
            self.penalty.np,
            self.recip.np,
        )
        self._penalty_dev = self.penalty.dev[:0]
        self._recip_dev = self.recip.dev[:0]
        # Per-step scratch, sized for the worst case once.
        self._lens = np.zeros(n, dtype=np.int64)
        self._put_rows = Staged(n, torch.int64, self.device)
        self._put_cols = Staged(n, torch.int64, self.device)
        self._put_toks = Staged(n, torch.int64, self.device)
        self._vals = torch.empty(n * m, dtype=torch.float32, device=self.device)
        if not self._divide:  # the CPU path scales in place through these
            self._scale = torch.empty(n * m, dtype=torch.float32, device=self.device)
            self._positive = torch.empty(n * m, dtype=torch.bool, device=self.device)
        self._any = False

    def is_argmax_invariant(self) -> bool:
        return False

    # -- batch changes -------------------------------------------------------------------

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not self.rows.update(batch_update, self._add):
            return
        b = self.rows.batch_size
        self._any = self.rows.any_active()
        self._penalty_dev = self.penalty.upload(b).unsqueeze(1)
        self._recip_dev = self.recip.upload(b).unsqueeze(1)

    def _add(
        self, row: int, params: SamplingParams, prompt: list[int] | None, out: list[int]
    ) -> bool:
        args = RequestArgs.of(params)
        if args is not None and args.penalised and not prompt:
            # Raising here would fail the whole engine step: leave this request alone.
            log.error("tensor repetition penalty needs the prompt's token ids: not applied")
            args = None
        seen = self._seen_prompt(prompt) if args is not None and args.penalised else None
        if args is None or not args.penalised or seen is None:
            self.penalty.np[row] = 1.0
            self.recip.np[row] = 1.0
            return False
        p = np.float32(args.repetition_penalty)
        self.penalty.np[row] = p
        self.recip.np[row] = np.float32(1.0) / p
        n_out = _resolved(out)
        tokens = np.full(self.history.shape[1], seen[0], dtype=np.int64)
        tokens[: len(prompt)] = seen
        tokens[len(prompt) : len(prompt) + n_out] = out[:n_out]
        # One row upload per (re)join, not per step; on CUDA a pageable copy that holds
        # the host until staged, acceptable at join time.
        self.history[row].copy_(torch.from_numpy(tokens))
        self.prompt_len[row] = len(prompt)
        self.seq_len[row] = len(prompt) + n_out
        self.ingested[row] = n_out
        return True

    def _seen_prompt(self, prompt: list[int]) -> np.ndarray | None:
        """The prompt as history columns: ids without a logit become the first id with one
        (None, logged, if none has one: the penalty is then not applied)."""
        ids = np.asarray(prompt, dtype=np.int64)
        outside = ids >= self.width
        if not outside.any():
            return ids
        inside = ids[~outside]
        if len(inside) == 0:
            log.error("tensor repetition penalty: no prompt id within the logits: not applied")
            return None
        ids[outside] = inside[0]
        return ids

    # -- every step ----------------------------------------------------------------------

    def _ingest(self, b: int) -> None:
        """Fold the tokens sampled since the last step into the history."""
        lens = self.rows.output_lengths(self._lens)
        active = self.rows.active[:b]
        delta = lens - self.ingested[:b]
        one = np.flatnonzero(active & (delta == 1))
        if len(one):
            toks = self.rows.last_tokens(one)
            resolved = toks >= 0  # -1: an async-scheduling placeholder not yet filled in
            if not resolved.all():
                one, toks = one[resolved], toks[resolved]
            k = len(one)
            self._put_rows.np[:k] = one
            self._put_cols.np[:k] = self.seq_len[one]
            self._put_toks.np[:k] = toks
            self.history.index_put_(
                (self._put_rows.upload(k), self._put_cols.upload(k)), self._put_toks.upload(k)
            )
            self.seq_len[one] += 1
            self.ingested[one] += 1
        for row in np.flatnonzero(active & (delta != 1) & (delta != 0)):
            self._rewrite_outputs(int(row))

    def _rewrite_outputs(self, row: int) -> None:
        """Rare: several new tokens at once, or the runner discarded some (rewinds)."""
        out = self.rows.outputs[row]
        n_out = _resolved(out)
        start = int(self.prompt_len[row])
        end = start + n_out
        old_end = int(self.seq_len[row])
        pad = self.history[row, 0]
        # A pageable upload like a join's; this path is off the steady state.
        self.history[row, start:end] = torch.as_tensor(out[:n_out], dtype=torch.int64)
        if old_end > end:
            self.history[row, end:old_end] = pad
        self.seq_len[row] = end
        self.ingested[row] = n_out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self._any:
            return logits
        b = logits.shape[0]
        if b != self.rows.batch_size:
            raise RuntimeError(f"logits have {b} rows, the batch {self.rows.batch_size}")
        self._ingest(b)
        width = int(self.seq_len[:b][self.rows.active[:b]].max())
        index = self.history[:b, :width]
        vals = self._vals[: b * width].view(b, width)
        torch.gather(logits, 1, index, out=vals)
        if self._divide:
            vals = torch.where(vals > 0, vals / self._penalty_dev, vals * self._penalty_dev)
        else:
            positive = self._positive[: b * width].view(b, width)
            scale = self._scale[: b * width].view(b, width)
            torch.gt(vals, 0, out=positive)
            torch.where(positive, self._recip_dev, self._penalty_dev, out=scale)
            vals.mul_(scale)
        logits.scatter_(1, index, vals)
        return logits


def _resolved(out: list[int]) -> int:
    """Number of leading output tokens that are real (not async placeholders, -1)."""
    if not out or out[-1] >= 0:
        return len(out)
    return out.index(-1)
