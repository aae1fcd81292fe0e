"""The last decode's logits rows, read where llama.cpp keeps them, and sampling there.

Invariants:
- ``llama_get_logits`` holds the rows of the tokens whose batch logits flag was set,
  contiguously, in batch order (llama.h): a step's wanted rows are one [n, V] float32
  view, no copy. The view is valid until the next ``llama_decode`` (which overwrites,
  and may reallocate, that buffer): ``step`` copies what it returns, ``step_sampled``
  reads the view and returns token ids only.
- In-runtime sampling is the executor's host sampler (superfluid/sampling.py) run on the
  same float32 row: greedy is ``np.argmax`` (lowest id wins ties), a temperature draw is
  ``sampling.sample`` with ``sampling.uniform(rng_position)``. The host path would pick
  from a copy of exactly these values with exactly these functions, so the tokens are
  the same bit for bit; what is saved is the copy, the row's trip through the
  executor's bookkeeping, and (for greedy) one argmax call per lane.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np

import llama_cpp as L

from ... import sampling as hs
from ..base import Fatal, SampleSpec


class LogitsView:
    """[n, V] views of a context's output rows, rebuilt only when llama.cpp's buffer moves."""

    def __init__(self, ctx, vocab_size: int):
        self._ctx = ctx
        self._V = vocab_size
        self._key: tuple[int, int] | None = None
        self._view: np.ndarray | None = None

    def rows(self, n: int) -> np.ndarray:
        """The last decode's n output rows (n = logits flags it was given)."""
        addr = ctypes.cast(L.llama_get_logits(self._ctx), ctypes.c_void_p).value
        if not addr:
            raise Fatal("llama.cpp has no logits for the last decode")
        if self._key != (addr, n):
            buf = (ctypes.c_float * (n * self._V)).from_address(addr)
            self._view = np.frombuffer(buf, dtype=np.float32).reshape(n, self._V)
            self._key = (addr, n)
        return self._view


def sample_rows(rows: np.ndarray, specs: Sequence[SampleSpec]) -> list[int]:
    """rows: [B, V] float32, one per spec -> one token per lane, as the host would pick it."""
    if all(s.temperature <= 0.0 for s in specs):
        return np.argmax(rows, axis=1).tolist()  # per row: the first maximum, as hs.argmax
    return [hs.argmax(row) if s.temperature <= 0.0 else hs.sample(row, s.lane_params(), hs.uniform(s.rng_position))
            for row, s in zip(rows, specs)]
