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
- The walk is defined to the bit: weights are integers (``weights``), so every sum and
  threshold is exact in any order; ties keep the lowest ids. A vectorised sampler
  (runtimes/torch/sample.py) computes the same function with the same operations; only
  the float32 exp must be the same implementation (numpy's, on a CPU).
"""

from __future__ import annotations

import math
from fractions import Fraction
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


TEMPERATURE_FLOOR = 1e-6  # a sampled row is divided by max(temperature, this)
WEIGHT_BITS = 40  # a weight is an integer in [0, 2^40]; the best token weighs 2^40
ID_BITS = 20  # vocabularies up to 2^20 ids: every sum (< 2^60) and sort key fits in int64
MAX_VOCAB = 1 << ID_BITS
_ONE = float(1 << WEIGHT_BITS)
_DRAW = float(1 << 53)


def weights(row: np.ndarray, temperature: float) -> np.ndarray:
    """The row's integer weights: floor(2^40 * exp((x - max) / t)) in float32 arithmetic, so
    the best weighs 2^40 and ids below ~e^-27.7 of it (or at -inf) weigh 0 and are never
    drawn. Integer sums are exact in any order, which is what lets a batched or parallel
    sampler compute this function bit for bit; only exp must be the same one (numpy's)."""
    x = np.asarray(row, dtype=np.float32)
    if x.shape[0] > MAX_VOCAB:
        raise ValueError(f"a row of {x.shape[0]} ids: the sampler takes at most {MAX_VOCAB}")
    m = x.max()
    if not np.isfinite(m):  # no finite logit (the caller's invariant says there is one): every id alike
        return np.full(x.shape[0], 1 << WEIGHT_BITS, dtype=np.int64)
    d = (x - m) / np.float32(max(temperature, TEMPERATURE_FLOOR))
    return (np.exp(d) * np.float32(_ONE)).astype(np.int64)


def sort_keys(w: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Unique int64 keys, larger for a heavier id and, among equal weights, for a lower id."""
    return (w << ID_BITS) + ((MAX_VOCAB - 1) - ids)


def min_p_floor(min_p: float) -> int:
    """The least weight min-p keeps: ceil(min_p * 2^40), exact."""
    return math.ceil(Fraction(min_p) * (1 << WEIGHT_BITS)) if min_p > 0.0 else 1


def nucleus_mass(top_p: float, total: int) -> int:
    """top-p's mass in weight units: the least integer >= top_p * total, exact."""
    return math.ceil(Fraction(top_p) * total)


def nucleus_floor(top_p: float, total: int, n: int) -> int:
    """A weight every nucleus token reaches, given n kept tokens: those below it weigh at most
    total - mass in all, so the walk's prefix at or above it already holds the nucleus (and
    is a prefix: ties at the floor are in). Never above the best's weight."""
    return min((total - nucleus_mass(top_p, total)) // n + 1, 1 << WEIGHT_BITS)  # the best is always in


def draw_point(u: float, total: int) -> int:
    """The draw's point in [0, total): floor(u * total) with u's 53 bits, exact. The token is
    the first of the walk whose running weight exceeds it."""
    return (int(u * _DRAW) * total) >> 53


def _kept(row: np.ndarray, params: LaneParams) -> np.ndarray:
    """The row's weights with min-p's cut as zeros."""
    w = weights(row, params.temperature)
    if params.min_p > 0.0:
        w[w < min_p_floor(params.min_p)] = 0
    return w


def _ordered(params: LaneParams, n: int) -> bool:
    return 0 < params.top_k < n or params.top_p < 1.0


def _top_k(ids: np.ndarray, w: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k largest sort keys. First a floor no higher than the k-th weight: the least of
    k disjoint slices' maxima (k weights reach it), one cheap pass."""
    t = w[: (w.shape[0] // k) * k].reshape(k, -1).max(axis=1).min()
    part = np.flatnonzero(w >= t)
    ids, w = ids[part], w[part]
    if ids.shape[0] > k:
        part = np.argpartition(sort_keys(w, ids), ids.shape[0] - k)[ids.shape[0] - k:]
        ids, w = ids[part], w[part]
    return ids, w


def walk(row: np.ndarray, params: LaneParams) -> tuple[np.ndarray, np.ndarray]:
    """The inverse CDF's walk after temperature, top-k, min-p and top-p: token ids and their
    integer weights (``weights``), zero weights left out. The walk is by descending weight
    (ties: lowest id first) when top-k or top-p is on, else by id, which spares sorting.
    top-k keeps the k best in that order; min-p keeps weights >= min_p * 2^40 (the best's
    share); top-p keeps the walk's shortest prefix whose weight reaches top_p of the kept."""
    w = _kept(row, params)
    n = w.shape[0]
    ids = np.flatnonzero(w)
    w = w[ids]
    if not _ordered(params, n):
        return ids, w
    if 0 < params.top_k < ids.shape[0]:
        ids, w = _top_k(ids, w, params.top_k)
    if params.top_p < 1.0:
        total = int(w.sum())
        part = np.flatnonzero(w >= nucleus_floor(params.top_p, total, ids.shape[0]))
        ids, w = ids[part], w[part]
    order = np.argsort(-sort_keys(w, ids))
    ids, w = ids[order], w[order]
    if params.top_p < 1.0:
        cum = np.cumsum(w)
        cut = int(np.searchsorted(cum, nucleus_mass(params.top_p, total), side="left")) + 1
        ids, w = ids[:cut], w[:cut]
    return ids, w


def candidates(row: np.ndarray, params: LaneParams) -> tuple[np.ndarray, np.ndarray]:
    """The walk's token ids and their probabilities (which sum to 1)."""
    ids, w = walk(row, params)
    return ids, w / w.sum()


def sample(row: np.ndarray, params: LaneParams, u: float) -> int:
    """Inverse CDF: the first token of the walk whose running weight exceeds the draw's point
    (``draw_point``); there always is one, since the point is below the total. By id, the
    running sum over the whole row (zeros add nothing) points at the id itself."""
    if _ordered(params, np.shape(row)[0]):
        ids, w = walk(row, params)
    else:
        ids, w = None, _kept(row, params)
    cum = np.cumsum(w)
    at = int(np.searchsorted(cum, draw_point(u, int(cum[-1])), side="right"))
    return at if ids is None else int(ids[at])
