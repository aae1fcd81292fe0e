"""In-runtime sampling: the host sampler (superfluid/sampling.py) in torch, batched over
the lanes on the logits' device: the same function, step for step.

Each step is sampling.walk / sampling.sample's, in the same floating-point operations:
- A lane's draw is ``sampling.uniform(spec.rng_position)``: splitmix64 on the host, one
  float per lane, so a lane's token does not depend on what else shares the batch.
- Greedy lanes (temperature 0) take argmax of the float32 row, lowest id winning ties.
- Sampled lanes, in float64: x = row / max(temperature, TEMPERATURE_FLOOR); top-k keeps
  the k largest x (when 0 < k < V; ties at the k-th value: the lowest ids,
  ``sampling.top_k_ids``), else every finite x; weights w = exp(x - max), the best weighs 1;
  min-p keeps w >= min_p; top-p keeps the smallest prefix of the walk whose running sum of
  w, over the running sum of w in id order, reaches top_p (at least one token); the token
  is the first whose running weight over the kept total exceeds u (the last if none does).
- The walk is by descending w, lowest id first on ties, when top-k or top-p is on;
  otherwise by id. Every sum is a running sum (cumsum) in that order, as on the host;
  tests/test_torch_sample.py checks the tokens are equal on thousands of random rows.

Rows are finite or -inf (a grammar's mask), with at least one finite logit. A GPU's exp
and scans may round differently from the CPU's; on a CPU the operations are numpy's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ... import sampling
from ..base import SampleSpec


def _exp(x: torch.Tensor) -> torch.Tensor:
    """exp as the host computes it. numpy's and torch's float64 exp differ in the last bit for
    ~2% of inputs on some CPUs (numpy's AVX-512 exp on a Zen 4): on a CPU this is numpy's,
    run on the tensor's own memory."""
    if x.device.type != "cpu":
        return torch.exp(x)
    x = x.contiguous()
    return torch.from_numpy(np.exp(x.numpy()))


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
    cols = torch.tensor([[max(s.temperature, sampling.TEMPERATURE_FLOOR), s.top_k if 0 < s.top_k < V else 0,
                          s.top_p, s.min_p, sampling.uniform(s.rng_position), float(s.top_p < 1.0 or 0 < s.top_k < V)]
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
    w = _exp(x - best)  # [S, V]; the best candidate weighs 1
    cand &= (min_p <= 0.0) | (w >= min_p)

    # The walk: candidates first, by descending w (stable: lowest id first on ties) or by id.
    key = torch.where(cand, torch.where(ordered, w, 1.0), -1.0)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices  # [S, V]
    cs = cand.gather(1, order)  # a prefix of each row
    ws = torch.where(cs, w.gather(1, order), 0.0)
    n_cand = cs.sum(-1, keepdim=True)
    pos = torch.arange(V, device=dev)[None]

    # top-p: the smallest prefix whose mass reaches top_p (searchsorted left, + 1); the
    # total is the running sum of the candidates' w in id order (zeros add nothing).
    cum = ws.cumsum(-1) / torch.where(cand, w, 0.0).cumsum(-1)[:, -1:]
    cut = torch.minimum(((cum < top_p) & cs).sum(-1, keepdim=True) + 1, n_cand)
    keep = cs & ((top_p >= 1.0) | (pos < cut))
    wk = torch.where(keep, ws, 0.0)

    # Inverse CDF: the first kept token whose cumulative probability exceeds u.
    cdf = wk.cumsum(-1)
    cdf = cdf / cdf[:, -1:]
    n_keep = keep.sum(-1, keepdim=True)
    at = torch.minimum(((cdf <= u) & keep).sum(-1, keepdim=True), n_keep - 1).clamp(min=0)
    return torch.where(n_keep[:, 0] > 0, order.gather(1, at)[:, 0], greedy)
