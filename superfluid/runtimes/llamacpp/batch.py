"""One ``llama_batch`` for a step: every feed's tokens, each with its position and
sequence, and a logits flag only where a row is asked for.

llama.cpp's rules the layout keeps: a sequence's tokens in one batch are consecutive
and continue its memory (position = tokens it holds, then +1 each); each token belongs
to one sequence (no coupled sequences); ids are below ``n_seq_max``. A recurrent
memory then cuts the batch into equal-length splits itself (``split_equal``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

import llama_cpp as L

from ..base import Feed


class StepBatch:
    """A reusable batch of ``capacity`` tokens (llama_batch_init); ``close()`` frees it."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.raw = L.llama_batch_init(capacity, 0, 1)
        self.token = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self._seq_id = self.raw.seq_id  # one malloc'd slot per token: written one by one
        self._closed = False

    def fill(self, feeds: Sequence[Feed], starts: Sequence[int], every: bool) -> list[list[int]]:
        """Lay the feeds out; returns, per feed, the batch indexes whose rows come back."""
        n = sum(len(f.tokens) for f in feeds)
        if n > self.capacity:
            raise ValueError(f"{n} tokens > the batch's {self.capacity}")
        at = 0
        outs: list[list[int]] = []
        for f, start in zip(feeds, starts):
            k = len(f.tokens)
            self.token[at: at + k] = f.tokens
            self.pos[at: at + k] = np.arange(start, start + k, dtype=np.int32)
            self.n_seq_id[at: at + k] = 1
            sid = self._seq_id
            for i in range(at, at + k):
                sid[i][0] = f.seq
            if every:
                self.logits[at: at + k] = 1
                outs.append(list(range(at, at + k)))
            else:
                self.logits[at: at + k] = 0
                if f.wants_row:
                    self.logits[at + k - 1] = 1
                    outs.append([at + k - 1])
                else:
                    outs.append([])
            at += k
        self.raw.n_tokens = n
        return outs

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            L.llama_batch_free(self.raw)
