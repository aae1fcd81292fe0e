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
class Layer:
    """One layer's weights; matrices are ``llama.Mat`` (compute-dtype, bf16 or quantized copies)."""

    attn_norm: torch.Tensor  # [D]
    wqkv: object  # Mat [(H + 2 Hkv) d, D]: q rows, k rows, v rows
    bqkv: torch.Tensor | None  # [(H + 2 Hkv) d] (qwen2), else None
    wo: object  # Mat [D, H d]
    ffn_norm: torch.Tensor  # [D]
    wgu: object  # Mat [2 F, D]: gate rows then up rows
    wdown: object  # Mat [D, F]


class Kernels(Protocol):
    """How one step computes each op of a layer (positions, cells and masks bound at creation)."""

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...  # RMS norm, [T, D]

    def linear(self, x: torch.Tensor, m, b: torch.Tensor | None = None) -> torch.Tensor: ...  # x W^T + b

    def add_linear(self, x: torch.Tensor, y: torch.Tensor, m) -> torch.Tensor: ...  # x + y W^T (may write x)

    def rope_store(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor: ...
    # RoPE on q and k of qkv [T, (H + 2 Hkv) d]; k, v written to this step's cells of kc, vc
    # [S, Hkv, d]; returns q [T, H, d]

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor: ...  # [T, H, d]

    def gate(self, gu: torch.Tensor) -> torch.Tensor: ...  # [T, 2F] -> silu(gate) * up [T, F]


def layer(k: Kernels, x: torch.Tensor, L: Layer, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
    """x [T, D] (the residual stream; a kernel set may add into it in place) -> [T, D]."""
    T = x.shape[0]
    qkv = k.linear(k.norm(x, L.attn_norm), L.wqkv, L.bqkv)  # [T, (H + 2 Hkv) d]
    q = k.rope_store(qkv, kc, vc)  # every row's k/v is stored before any row attends
    a = k.attend(q, kc, vc)  # [T, H, d]
    x = k.add_linear(x, a.reshape(T, -1), L.wo)
    gu = k.linear(k.norm(x, L.ffn_norm), L.wgu)  # [T, 2F]
    return k.add_linear(x, k.gate(gu), L.wdown)


def run(k: Kernels, layers: list[Layer], norm: torch.Tensor, x: torch.Tensor, kv_k: torch.Tensor,
        kv_v: torch.Tensor) -> torch.Tensor:
    """Every layer over embeddings x [T, D], then the final norm. kv_k, kv_v: [n_layers, S, Hkv, d]."""
    for li, L in enumerate(layers):
        x = layer(k, x, L, kv_k[li], kv_v[li])
    return k.norm(x, norm)
