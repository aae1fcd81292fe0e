"""The Llama-family decoder layer, described once, and the kernel sets that run it.

A layer over packed tokens x [T, D] is

    norm -> qkv (+ bias) -> RoPE + K/V store -> attention -> o (+ residual)
         -> norm -> gate/up -> SiLU gating -> down (+ residual)

and the model is the layers in order, then the final norm. ``layer`` and ``run`` below are
that description; what differs between routes is only *how* each op is computed, a
``Kernels`` set bound to one step:
- ``llama.TorchKernels``: torch ops (the reference numerics, or the batch-invariant
  ``linear_fixed`` / ``attend_fixed`` in deterministic mode);
- ``native.NativeKernels``: the C kernels of kernels.c, op by op (quantized GEMV).

kernels.c's ``sf_decode`` is the one other writing of this sequence: the same C kernels as
``NativeKernels`` called from C, one call per step, because a Python round trip per op costs
more than the ops on a decode step (measured: native.py's module doc). tests/test_whole_step.py
holds it to this description, bit for bit, on every architecture feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class Experts:
    """A mixture-of-experts feed-forward: the router and each expert's (gate/up, down) pair."""

    router: object  # Mat [E, D]
    wgu: list  # per expert Mat [2 F, D]
    wdown: list  # per expert Mat [D, F]
    used: int  # experts per token
    renormalise: bool  # the top weights divided by their sum
    native: object = None  # kernels.moe_struct's C view, built on first use


@dataclass
class Layer:
    """One layer's weights; matrices are ``llama.Mat`` (compute-dtype, bf16 or quantized copies).
    The optional parts are the architecture options of config.py (None: the option is off)."""

    attn_norm: torch.Tensor | None  # [D] (None: no pre-norm, OLMo 2)
    wqkv: object  # Mat [(H + 2 Hkv) d, D]: q rows, k rows, v rows
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) d] (qwen2), else None
    wo: object  # Mat [D, H d]
    ffn_norm: torch.Tensor | None  # [D]
    wgu: object  # Mat [2 F, D]: gate rows then up rows (None with experts)
    wdown: object  # Mat [D, F]
    q_norm: torch.Tensor | None = None  # [d] per head, or [H d] over all heads
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # [D]: on the attention output, before the residual add
    post_ffn_norm: torch.Tensor | None = None
    rope: int | None = 0  # which RoPE table this layer rotates with (None: it does not rotate)
    window: int | None = None  # its sliding window (None: full attention)
    experts: Experts | None = None


@dataclass(frozen=True)
class Options:
    """The model-wide options a layer reads (config.py's module doc)."""

    q_scale: float = 1.0  # q is multiplied by it: the model's attention scale over head_dim ** -0.5
    residual_scale: float = 1.0
    activation: str = "silu"
    softcap: float | None = None


class Kernels(Protocol):
    """How one step computes each op of a layer (positions, cells and masks bound at creation)."""

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...  # RMS norm over the last dim

    def linear(self, x: torch.Tensor, m, b: torch.Tensor | None = None) -> torch.Tensor: ...  # x W^T + b

    def add_linear(self, x: torch.Tensor, y: torch.Tensor, m) -> torch.Tensor: ...  # x + y W^T (may write x)

    def rope_store(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rope: int | None) -> torch.Tensor: ...
    # RoPE (table ``rope``; None: none) on q and k of qkv [T, (H + 2 Hkv) d]; k, v written to
    # this step's cells of kc, vc [S, Hkv, d]; returns q [T, H, d]

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int | None,
               softcap: float | None) -> torch.Tensor: ...  # [T, H, d]

    def gate(self, gu: torch.Tensor, activation: str) -> torch.Tensor: ...  # [T, 2F] -> act(gate) * up [T, F]

    def experts(self, h: torch.Tensor, E: Experts, activation: str) -> torch.Tensor: ...
    # the mixture-of-experts feed-forward of h [T, D], before the residual add: experts() below


def _qk_norm(k: Kernels, qkv: torch.Tensor, L: Layer, H: int, Hkv: int, d: int) -> torch.Tensor:
    """q and k of qkv normed (per head when the weight is [d], over all heads when [H d]); v as is."""
    T = qkv.shape[0]
    q, kk, v = qkv.split([H * d, Hkv * d, Hkv * d], dim=1)
    per_head = L.q_norm.shape[0] == d
    q = k.norm(q.reshape(T * H, d) if per_head else q.contiguous(), L.q_norm).reshape(T, H * d)
    kk = k.norm(kk.reshape(T * Hkv, d) if per_head else kk.contiguous(), L.k_norm).reshape(T, Hkv * d)
    return torch.cat([q, kk, v], dim=1)


def _sublayer_out(k: Kernels, x: torch.Tensor, y: torch.Tensor, m, post: torch.Tensor | None,
                  o: Options) -> torch.Tensor:
    """x + scale * post_norm(y W^T): the residual add of one sublayer (fused when plain)."""
    if post is None and o.residual_scale == 1.0:
        return k.add_linear(x, y, m)
    out = k.linear(y, m)
    if post is not None:
        out = k.norm(out, post)
    return x + (out * o.residual_scale if o.residual_scale != 1.0 else out)


def experts(k: Kernels, h: torch.Tensor, E: Experts, activation: str) -> torch.Tensor:
    """The mixture-of-experts feed-forward of h [T, D] (before the down's residual add), as
    transformers: softmax over the router's logits in float32, the top ``used``, optionally
    renormalised; each expert runs once over the rows routed to it, weighted, summed in."""
    probs = torch.softmax(k.linear(h, E.router).float(), dim=-1)
    top, idx = torch.topk(probs, E.used, dim=-1)  # [T, used]
    if E.renormalise:
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(h.dtype)
    out = torch.zeros_like(h)
    for e in torch.unique(idx).tolist():  # the step's tokens grouped by expert
        rows, slot = torch.where(idx == e)
        y = k.linear(k.gate(k.linear(h.index_select(0, rows), E.wgu[e]), activation), E.wdown[e])
        out.index_add_(0, rows, y * top[rows, slot, None])
    return out


def layer(k: Kernels, x: torch.Tensor, L: Layer, kc: torch.Tensor, vc: torch.Tensor,
          o: Options = Options()) -> torch.Tensor:
    """x [T, D] (the residual stream; a kernel set may add into it in place) -> [T, D]."""
    T = x.shape[0]
    h = k.norm(x, L.attn_norm) if L.attn_norm is not None else x
    qkv = k.linear(h, L.wqkv, L.bqkv)  # [T, (H + 2 Hkv) d]
    if L.q_norm is not None:
        Hkv, d = kc.shape[1], kc.shape[2]
        qkv = _qk_norm(k, qkv, L, qkv.shape[1] // d - 2 * Hkv, Hkv, d)
    q = k.rope_store(qkv, kc, vc, L.rope)  # every row's k/v is stored before any row attends
    if o.q_scale != 1.0:
        q = q * o.q_scale
    a = k.attend(q, kc, vc, L.window, o.softcap)  # [T, H, d]
    x = _sublayer_out(k, x, a.reshape(T, -1), L.wo, L.post_attn_norm, o)
    h = k.norm(x, L.ffn_norm) if L.ffn_norm is not None else x
    if L.experts is not None:
        ffn = k.experts(h, L.experts, o.activation)
        if L.post_ffn_norm is not None:
            ffn = k.norm(ffn, L.post_ffn_norm)
        return x + (ffn * o.residual_scale if o.residual_scale != 1.0 else ffn)
    gu = k.linear(h, L.wgu)  # [T, 2F]
    return _sublayer_out(k, x, k.gate(gu, o.activation), L.wdown, L.post_ffn_norm, o)


def run(k: Kernels, layers: list[Layer], norm: torch.Tensor, x: torch.Tensor, kv_k: torch.Tensor,
        kv_v: torch.Tensor, o: Options = Options()) -> torch.Tensor:
    """Every layer over embeddings x [T, D], then the final norm. kv_k, kv_v: [n_layers, S, Hkv, d]."""
    for li, L in enumerate(layers):
        x = layer(k, x, L, kv_k[li], kv_v[li], o)
    return k.norm(x, norm)
