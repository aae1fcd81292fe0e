"""In-runtime sampling: the executor's host sampler (superfluid/sampling.py) in torch, batched
over the lanes on the logits' device, drawing the same tokens.

Invariants (each mirrors sampling.candidates / sampling.sample):
- A lane's draw is ``sampling.uniform(spec.rng_position)``: splitmix64 on the host, one
  float per lane, so a lane's token does not depend on what else shares the batch.
- Greedy lanes (temperature 0) take argmax of the float32 row, lowest id winning ties.
- Sampled lanes, in float64: x = row / max(temperature, 1e-6); top-k keeps the k largest
  x (when 0 < k < V), else every finite x; weights w = exp(x - max), the best weighs 1;
  min-p keeps w >= min_p; top-p keeps the smallest prefix of the walk whose cumulative
  w / total reaches top_p (at least one token); the token is the first whose cumulative
  probability w / sum(w) exceeds u (the last one if none does).
- The walk is by descending w, lowest id first on ties, when top-k or top-p is on;
  otherwise by id.

Where a token can differ from the host sampler (exact equality for every row cannot be
promised; tests/test_torch_sample.py checks thousands of random rows):
- Rounding: torch's exp may be 1 ulp from numpy's, and sums / cumsums associate
  differently (numpy sums pairwise, CUDA scans in parallel). Only a u, min_p or top_p
  within a few ulps of a boundary, or two weights that tie on one side only, can change
  the token: ~1e-15 per draw on real rows.
- Ties across the top-k boundary (or across the host's 512-token nucleus probe): numpy's
  argpartition keeps an arbitrary subset of the tied ids; here the lowest ids stay. Either
  token has the same logit.
- Rows with NaN or +inf logits are outside the contract (the host sampler returns garbage
  or raises); a lane left with no candidate here takes the argmax.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ... import sampling
from ..base import SampleSpec


def sample_lanes(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[int]:
    """logits: [B, V] float32, one row per spec; one token per lane (one host sync)."""
    tokens = torch.argmax(logits, dim=-1)  # [B]; first maximum: lowest id wins ties
    lanes = [i for i, s in enumerate(specs) if s.temperature > 0.0]
    if lanes:
        at = torch.tensor(lanes, dtype=torch.int64, device=logits.device)
        tokens[at] = _sample(logits[at], [specs[i] for i in lanes], tokens[at])
    return tokens.tolist()


def _sample(logits: torch.Tensor, specs: list[SampleSpec], greedy: torch.Tensor) -> torch.Tensor:
    """logits: [S, V] float32 of sampled lanes; greedy: [S] their argmax -> [S] tokens."""
    S, V = logits.shape
    dev = logits.device
    # One transfer of the per-lane settings: [S, 6] float64 (top_k is exact there).
    cols = torch.tensor([[max(s.temperature, 1e-6), s.top_k if 0 < s.top_k < V else 0, s.top_p, s.min_p,
                          sampling.uniform(s.rng_position), float(s.top_p < 1.0 or 0 < s.top_k < V)]
                         for s in specs], dtype=torch.float64, device=dev)
    temp, k, top_p, min_p, u, ordered = (cols[:, j: j + 1] for j in range(6))  # each [S, 1]
    k, ordered = k.long(), ordered.bool()

    x = logits.double() / temp  # [S, V]
    finite = torch.isfinite(x)
    cand = finite | ~finite.any(-1, keepdim=True)  # the host's fallback: every id when none is finite
    use_k = k > 0
    if bool(use_k.any()):
        kth = torch.topk(x, int(k.max()), dim=-1).values.gather(1, (k - 1).clamp(min=0))  # [S, 1]
        above, tied = x > kth, x == kth
        in_k = above | (tied & (tied.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # lowest tied ids
        cand = torch.where(use_k, in_k, cand)
    best = torch.where(cand, x, -torch.inf).amax(-1, keepdim=True)
    w = torch.exp(x - best)  # [S, V]; the best candidate weighs 1
    cand &= (min_p <= 0.0) | (w >= min_p)

    # The walk: candidates first, by descending w (stable: lowest id first on ties) or by id.
    key = torch.where(cand, torch.where(ordered, w, 1.0), -1.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [S, V]
    cs = cand.gather(1, order)  # a prefix of each row
    ws = torch.where(cs, w.gather(1, order), 0.0)
    n_cand = cs.sum(-1, keepdim=True)
    pos = torch.arange(V, device=dev)[None]

    # top-p: the smallest prefix whose mass reaches top_p (searchsorted left, + 1).
    cum = ws.cumsum(-1) / ws.sum(-1, keepdim=True)
    cut = torch.minimum(((cum < top_p) & cs).sum(-1, keepdim=True) + 1, n_cand)
    keep = cs & ((top_p >= 1.0) | (pos < cut))
    wk = torch.where(keep, ws, 0.0)

    # Inverse CDF: the first kept token whose cumulative probability exceeds u.
    cdf = (wk / wk.sum(-1, keepdim=True)).cumsum(-1)
    n_keep = keep.sum(-1, keepdim=True)
    at = torch.minimum(((cdf <= u) & keep).sum(-1, keepdim=True), n_keep - 1).clamp(min=0)
    return torch.where(n_keep[:, 0] > 0, order.gather(1, at)[:, 0], greedy)
