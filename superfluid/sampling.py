"""Sampling: pure functions of a logits row and a counter-based draw. A leaf: the
executor's host rows, the engine's host pick, the toy and llamacpp runtimes use these
functions; the torch runtime's batched sampler computes the same ones.

Invariants:
- A draw is ``uniform(rng_base + rng_counter)``: a hash of the position, never a
  stateful generator, so the same seed and the same token path give the same tokens
  whatever else shares the batch.
- Greedy is argmax with the lowest token id winning ties (``np.argmax`` keeps the first).
- Row order (as the reference): grammar mask, logit bias, penalties, then greedy or
  temperature / top-k / top-p / min-p by inverse CDF. Logprobs come from the row after
  bias and penalties, before temperature.
- Every function works on whole rows with numpy; nothing loops over the vocabulary.
- The walk is defined to the bit: ties at the top-k edge keep the lowest ids, and every
  sum is a running (sequential) sum in a stated order, so a vectorised sampler
  (runtimes/torch/sample.py) can compute the same function with the same operations.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

from .abi import LaneParams

_MASK64 = (1 << 64) - 1
PENALTY_WINDOW = 64  # penalties look at this many of the lane's last tokens


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform(position: int) -> float:
    """A uniform in [0, 1) that is a pure function of the position (53 bits)."""
    return (splitmix64(position & _MASK64) >> 11) * (1.0 / (1 << 53))


def penalizes(params: LaneParams) -> bool:
    repeat = params.repeat_penalty
    return (repeat not in (0.0, 1.0)) or params.presence_penalty != 0.0 or params.freq_penalty != 0.0


def argmax(row: np.ndarray) -> int:
    return int(np.argmax(row))


def apply_logit_bias(row: np.ndarray, bias: tuple[np.ndarray, np.ndarray]) -> None:
    ids, values = bias
    row[ids] += values


def apply_penalties(row: np.ndarray, tail: Iterable[int], params: LaneParams, exempt: frozenset[int]) -> None:
    """Repeat (divide positive logits, multiply negative ones), presence and frequency
    penalties over the tokens in ``tail``; special tokens and EOS are exempt."""
    if not penalizes(params):
        return
    tail = [t for t in tail if t not in exempt]
    if not tail:
        return
    ids, counts = np.unique(np.asarray(tail, dtype=np.int64), return_counts=True)
    vals = row[ids]
    repeat = params.repeat_penalty
    if repeat not in (0.0, 1.0):
        vals = np.where(vals > 0, vals / repeat, vals * repeat)
    vals = vals - params.freq_penalty * counts - params.presence_penalty
    row[ids] = vals.astype(row.dtype, copy=False)


def log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    finite = np.isfinite(x)
    m = x[finite].max() if finite.any() else 0.0
    z = np.log(np.exp(x - m).sum()) + m
    return x - z


def logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's logprob and the k most likely (ties: lowest id first)."""
    lp = log_softmax(row)
    top: list[tuple[int, float]] = []
    if k > 0:
        k = min(k, lp.shape[0])
        part = np.argpartition(-lp, k - 1)[:k]
        order = np.lexsort((part, -lp[part]))
        top = [(int(part[i]), float(lp[part[i]])) for i in order]
    return float(lp[token]), top


NUCLEUS_PROBE = 512  # top-p first looks for its nucleus among this many best tokens
TEMPERATURE_FLOOR = 1e-6  # a sampled row is divided by max(temperature, this)


def _desc_order(ids: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Positions of ids by descending weight, lowest id first on ties."""
    return np.lexsort((ids, -w))


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest x, in id order; of ids tied at the k-th value, the lowest."""
    kth = np.partition(x, x.shape[0] - k)[x.shape[0] - k]
    above = np.flatnonzero(x > kth)
    tied = np.flatnonzero(x == kth)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, tied]))


def _nucleus(ids: np.ndarray, w: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """ids (in id order) and weights -> the walk's smallest prefix whose mass reaches top_p.
    The mass is the walk's running sum over the running sum of w in id order. The probe
    takes every weight tied at its edge, so its walk is a prefix of the whole walk."""
    n = ids.shape[0]
    total = np.cumsum(w)[-1]
    part = np.arange(n)
    if NUCLEUS_PROBE < n:
        part = np.flatnonzero(w >= np.partition(w, n - NUCLEUS_PROBE)[n - NUCLEUS_PROBE])
    order = part[_desc_order(ids[part], w[part])]
    cum = np.cumsum(w[order]) / total
    if cum[-1] < top_p and part.shape[0] < n:
        order = _desc_order(ids, w)  # a flat distribution: sort it all
        cum = np.cumsum(w[order]) / total
    cut = min(int(np.searchsorted(cum, top_p, side="left")) + 1, n)  # at least one token
    return ids[order[:cut]], w[order[:cut]]


def walk(row: np.ndarray, params: LaneParams) -> tuple[np.ndarray, np.ndarray]:
    """The inverse CDF's walk after temperature, top-k, top-p and min-p: token ids and
    their weights (the best weighs 1). The walk is by descending weight (ties: lowest id
    first) when top-k or top-p is on, else by id, which spares sorting the vocabulary."""
    x = row.astype(np.float64) / max(params.temperature, TEMPERATURE_FLOOR)
    n = x.shape[0]
    top_k = 0 < params.top_k < n
    if top_k:
        ids = top_k_ids(x, params.top_k)
    else:
        ids = np.flatnonzero(np.isfinite(x))
        if ids.size == 0:
            ids = np.arange(n)
    logits = x[ids]
    w = np.exp(logits - logits.max())
    if params.min_p > 0.0:
        keep = w >= params.min_p
        ids, w = ids[keep], w[keep]
    if params.top_p < 1.0:
        return _nucleus(ids, w, params.top_p)
    if top_k:
        order = _desc_order(ids, w)
        ids, w = ids[order], w[order]
    return ids, w


def candidates(row: np.ndarray, params: LaneParams) -> tuple[np.ndarray, np.ndarray]:
    """The walk's token ids and their probabilities (which sum to 1)."""
    ids, w = walk(row, params)
    return ids, w / w.sum()


def sample(row: np.ndarray, params: LaneParams, u: float) -> int:
    """Inverse CDF: the first token of the walk whose running weight over the total
    (the running sum's last value) exceeds u; the last one if none does."""
    ids, w = walk(row, params)
    cum = np.cumsum(w)
    at = int(np.searchsorted(cum / cum[-1], u, side="right"))
    return int(ids[min(at, ids.shape[0] - 1)])
