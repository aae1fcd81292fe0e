"""One ``llama_batch`` for a step: every feed's tokens, each with its position and
sequence, and a logits flag only where a row is asked for.

llama.cpp's rules the layout keeps: a sequence's tokens in one batch are consecutive
and continue its memory (position = tokens it holds, then +1 each); each token belongs
to one sequence (no coupled sequences); ids are below ``n_seq_max``. A recurrent
memory then cuts the batch into equal-length splits itself (``split_equal``).

The batch's arrays are ours (numpy), not ``llama_batch_init``'s mallocs: the struct
only points into them, so a step fills them with slice writes (no per-token Python
loop) and nothing is allocated per step. ``seq_id`` is an array of pointers, one per
token, each aimed once at its own slot of ``seq_slot``; writing ``seq_slot`` is writing
the sequence ids. The struct must never reach ``llama_batch_free``.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

import llama_cpp as L

from ..base import Feed


def _ptr(a: np.ndarray, ctype):
    return a.ctypes.data_as(ctypes.POINTER(ctype))


class StepBatch:
    """A reusable batch of ``capacity`` tokens over numpy arrays it owns."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.token = np.zeros(capacity, dtype=np.int32)
        self.pos = np.zeros(capacity, dtype=np.int32)
        self.n_seq_id = np.ones(capacity, dtype=np.int32)  # each token is in exactly one sequence
        self.seq_slot = np.zeros(capacity, dtype=np.int32)  # token i's sequence id
        self.logits = np.zeros(capacity, dtype=np.int8)
        item = ctypes.POINTER(L.llama_seq_id)
        base = self.seq_slot.ctypes.data
        self._seq_ptrs = (item * capacity)(*(ctypes.cast(base + 4 * i, item) for i in range(capacity)))
        self.raw = L.llama_batch(
            n_tokens=0, token=_ptr(self.token, L.llama_token), embd=None, pos=_ptr(self.pos, L.llama_pos),
            n_seq_id=_ptr(self.n_seq_id, ctypes.c_int32), seq_id=self._seq_ptrs, logits=_ptr(self.logits, ctypes.c_int8))
        self._arange = np.arange(capacity, dtype=np.int32)

    def fill(self, feeds: Sequence[Feed], starts: Sequence[int], every: bool, last: bool = False) -> list[list[int]]:
        """Lay the feeds out; returns, per feed, the batch indexes whose rows come back:
        every position (``every``), else the last one of each feed that wants a row (of
        every feed with ``last``). Rows come back in batch order (llama_get_logits)."""
        n = sum(len(f.tokens) for f in feeds)
        if n > self.capacity:
            raise ValueError(f"{n} tokens > the batch's {self.capacity}")
        self.logits[:n] = 1 if every else 0
        at = 0
        outs: list[list[int]] = []
        for f, start in zip(feeds, starts):
            k = len(f.tokens)
            end = at + k
            self.token[at:end] = f.tokens
            self.pos[at:end] = self._arange[:k] + start  # positions continue the sequence
            self.seq_slot[at:end] = f.seq
            if every:
                outs.append(list(range(at, end)))
            elif f.wants_row or last:
                self.logits[end - 1] = 1
                outs.append([end - 1])
            else:
                outs.append([])
            at = end
        self.raw.n_tokens = n
        return outs

    def close(self) -> None:
        """Nothing to free: the arrays are numpy's (kept for API symmetry with the runtime)."""
