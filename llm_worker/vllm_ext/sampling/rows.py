"""Row bookkeeping for logits processors on vLLM's V1 (legacy) model runner.

The V1 runner keeps a *persistent batch*: request ``r`` occupies row ``i`` of the logits
until it finishes, is preempted, or is moved to fill a gap. Each step, before the forward
pass, every logits processor receives a :class:`BatchUpdate` describing what changed, to
be processed in the order removed, added, moved:

- ``removed``: rows whose request left the batch (finished, aborted or preempted);
- ``added``: ``(row, params, prompt ids, output ids)``; ``output ids`` is a *reference*
  to the request's live output list, which the runner appends to after every step. A
  request resumed after preemption is added again with the tokens it already has;
- ``moved``: ``(a, b, UNIDIRECTIONAL)`` moves row a to b (a becomes empty), ``(a, b, SWAP)``
  exchanges them.

:class:`RowTracker` applies these to the row-indexed state a processor registers with
:meth:`track` (numpy arrays and torch tensors, moved together), keeps each row's output
list, and tells which rows the processor is active for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import islice
from operator import itemgetter

import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

RowState = np.ndarray | torch.Tensor
OnAdd = Callable[[int, SamplingParams, list[int] | None, list[int]], bool]
"""``on_add(row, params, prompt_ids, output_ids) -> active``: initialise the row's state."""

LAST = itemgetter(-1)


class RowTracker:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.batch_size = 0
        self.outputs: list[list[int]] = [[] for _ in range(max_rows)]
        """Each row's live output-token list (an empty list for rows with no request)."""
        self.active = np.zeros(max_rows, dtype=bool)
        """Rows holding a request this processor acts on."""
        self._state: list[RowState] = [self.active]

    def track(self, *arrays: RowState) -> None:
        """Register row-indexed state (first dimension = row) to be moved with its row."""
        for a in arrays:
            if a.shape[0] != self.max_rows:
                raise ValueError("tracked state must have one entry per row")
        self._state.extend(arrays)

    def update(self, batch_update: BatchUpdate | None, on_add: OnAdd) -> bool:
        """Apply one step's batch changes; True if anything changed."""
        if batch_update is None:
            return False
        self.batch_size = batch_update.batch_size
        for row in batch_update.removed:
            self.outputs[row] = []
            self.active[row] = False
        for row, params, prompt_ids, output_ids in batch_update.added:
            self.outputs[row] = output_ids
            self.active[row] = on_add(row, params, prompt_ids, output_ids)
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self._swap(a, b)
            else:
                self._move(a, b)
        return True

    # Moves copy every row's state, active or not: a processor may rely on the
    # neutral values it gave an inactive row (a penalty of 1.0, say).
    def _move(self, a: int, b: int) -> None:
        self.outputs[b] = self.outputs[a]
        self.outputs[a] = []
        for s in self._state:
            s[b] = s[a]
        self.active[a] = False

    def _swap(self, a: int, b: int) -> None:
        self.outputs[a], self.outputs[b] = self.outputs[b], self.outputs[a]
        ab = [a, b]
        ba = [b, a]
        for s in self._state:
            s[ab] = s[ba]

    def any_active(self) -> bool:
        return bool(self.active[: self.batch_size].any())

    def output_lengths(self, out: np.ndarray) -> np.ndarray:
        """Each batch row's current number of output tokens, into ``out[:batch_size]``.

        One C-level pass over the runner's lists (``map(len, ...)``): no Python bytecode
        runs per row.
        """
        n = self.batch_size
        view = out[:n]
        view[:] = np.fromiter(map(len, islice(self.outputs, n)), dtype=np.int64, count=n)
        return view

    def last_tokens(self, rows: np.ndarray) -> np.ndarray:
        """The last output token of each row in ``rows`` (each must have one)."""
        if len(rows) == 1:
            return np.array([self.outputs[rows[0]][-1]], dtype=np.int64)
        lists: Iterator[list[int]] = iter(itemgetter(*rows)(self.outputs))
        return np.fromiter(map(LAST, lists), dtype=np.int64, count=len(rows))
