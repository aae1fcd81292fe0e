"""In-runtime sampling: the host sampler (superfluid/sampling.py), run lane by lane on a CPU
(numpy makes fewer passes over a row than a batch of int64 tensor ops) and, on another
device, in torch, batched over the lanes: the same function, step for step.

- A lane's draw is ``sampling.uniform(spec.rng_position)``: splitmix64 on the host, one
  float per lane, so a lane's token does not depend on what else shares the batch.
- Greedy lanes (temperature 0) take argmax of the float32 row, lowest id winning ties.
- Sampled lanes: the row's integer weights (``sampling.weights``: float32 arithmetic, then
  floor(2^40 * exp)), min-p's floor, top-k as the k largest ``sampling.sort_keys``, top-p's
  exact mass over the kept total, and the draw's point (``sampling.draw_point``): every sum,
  cut and comparison is on int64, so it is exact in any order, and only exp must be the
  host's (numpy's, run on the tensor's memory, on a CPU).
- The walk is by descending weight, lowest id first on ties, when top-k or top-p is on;
  otherwise by id. tests/test_torch_sample.py checks the tokens are equal on thousands of
  random rows.

Rows are finite or -inf (a grammar's mask); a row with no finite logit (or a NaN) weighs
every id alike, as on the host. A GPU's exp may round differently from the CPU's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ... import sampling
from ..base import SampleSpec

_ONE = float(1 << sampling.WEIGHT_BITS)
_FULL_SORT = 8  # a walk longer than V / this is sorted whole rather than by topk


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp as the host computes it: numpy's (numpy's and torch's differ in the last bit for
    some inputs on some CPUs), run on the tensor's own memory on a CPU."""
    if x.device.type != "cpu":
        return torch.exp(x)
    x = x.contiguous()
    return torch.from_numpy(np.exp(x.numpy()))


def sample_lanes(logits: torch.Tensor, specs: Sequence[SampleSpec], batched: bool | None = None) -> list[int]:
    """logits: [B, V] float32, one row per spec; one token per lane. batched (default: off
    a CPU) takes the torch batch on any device (tests check it against the host on a CPU)."""
    tokens = torch.argmax(logits, dim=-1)  # [B]; first maximum: lowest id wins ties
    lanes = [i for i, s in enumerate(specs) if s.temperature > 0.0]
    if not lanes:
        return tokens.tolist()
    out = tokens.tolist()
    if batched is None:
        batched = logits.device.type != "cpu"
    if not batched:  # the host's own function, lane by lane: fewer passes over a row than the batch's
        rows = logits.float().numpy()
        for i in lanes:
            out[i] = sampling.sample(rows[i], specs[i].lane_params(), sampling.uniform(specs[i].rng_position))
        return out
    at = torch.tensor(lanes, dtype=torch.int64, device=logits.device)
    for i, t in zip(lanes, _sample(logits[at], [specs[i] for i in lanes])):
        out[i] = t
    return out


def _weights(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """[S, V] float32 -> [S, V] int64: sampling.weights, then min-p and top-k (zeros out)."""
    S, V = logits.shape
    if V > sampling.MAX_VOCAB:
        raise ValueError(f"a row of {V} ids: the sampler takes at most {sampling.MAX_VOCAB}")
    dev = logits.device
    temp = torch.tensor([[max(s.temperature, sampling.TEMPERATURE_FLOOR)] for s in specs], dtype=torch.float32,
                        device=dev)
    m = logits.amax(-1, keepdim=True)
    d = torch.where(torch.isfinite(m), (logits - m) / temp, 0.0)
    w = (_exp(d) * _ONE).to(torch.int64)
    if any(s.min_p > 0.0 for s in specs):  # (a floor of 1 changes nothing: zeros stay zeros)
        floor = torch.tensor([[sampling.min_p_floor(s.min_p)] for s in specs], dtype=torch.int64, device=dev)
        w = torch.where(w >= floor, w, 0)
    ks = [s.top_k if 0 < s.top_k < V else 0 for s in specs]
    if any(ks):
        keys = sampling.sort_keys(w, torch.arange(V, device=dev))
        k = torch.tensor([[max(x, 1)] for x in ks], dtype=torch.int64, device=dev)
        kth = torch.topk(keys, max(ks), dim=-1).values.gather(1, k - 1)  # keys are unique
        use_k = torch.tensor([[x > 0] for x in ks], device=dev)
        w = torch.where(use_k & (keys < kth), 0, w)
    return w


def _sample(logits: torch.Tensor, specs: list[SampleSpec]) -> list[int]:
    """logits: [S, V] float32 of sampled lanes -> their tokens."""
    S, V = logits.shape
    dev = logits.device
    w = _weights(logits, specs)
    totals = w.sum(-1).tolist()
    ordered = [s.top_p < 1.0 or 0 < s.top_k < V for s in specs]
    kept = (w > 0).sum(-1).tolist() if any(s.top_p < 1.0 for s in specs) else [V] * S
    tokens = [0] * S

    by_id = [i for i in range(S) if not ordered[i]]
    if by_id:  # the walk by id: the first id whose running weight passes the point
        cum = w[by_id].cumsum(-1)
        points = torch.tensor([[sampling.draw_point(sampling.uniform(specs[i].rng_position), totals[i])]
                               for i in by_id], dtype=torch.int64, device=dev)
        for i, t in zip(by_id, torch.searchsorted(cum, points, right=True)[:, 0].tolist()):
            tokens[i] = t

    walked = [i for i in range(S) if ordered[i]]
    if walked:  # the walk by descending key over the weights at or above each lane's floor
        floors = torch.tensor([[sampling.nucleus_floor(specs[i].top_p, totals[i], kept[i])
                                if specs[i].top_p < 1.0 else 1] for i in walked], dtype=torch.int64, device=dev)
        ww = w[walked]
        keys = torch.where(ww >= floors, sampling.sort_keys(ww, torch.arange(V, device=dev)), -1)
        n = int((keys >= 0).sum(-1).max())
        if n * _FULL_SORT > V:
            top, idx = torch.sort(keys, dim=-1, descending=True)
            top, idx = top[:, :n], idx[:, :n]
        else:
            top, idx = torch.topk(keys, n, dim=-1)  # sorted, and unique keys: one order
        cum = torch.where(top >= 0, top >> sampling.ID_BITS, 0).cumsum(-1)  # [W, n]
        mass = torch.tensor([[sampling.nucleus_mass(specs[i].top_p, totals[i]) if specs[i].top_p < 1.0
                              else totals[i]] for i in walked], dtype=torch.int64, device=dev)
        cut = (cum < mass).sum(-1, keepdim=True)  # the last kept position (the mass is reached there)
        walk_totals = cum.gather(1, cut.clamp(max=n - 1))[:, 0].tolist()
        points = torch.tensor([[sampling.draw_point(sampling.uniform(specs[i].rng_position), t)]
                               for i, t in zip(walked, walk_totals)], dtype=torch.int64, device=dev)
        pos = (cum <= points).sum(-1, keepdim=True)
        for i, t in zip(walked, idx.gather(1, pos).tolist()):
            tokens[i] = t[0]
    return tokens
