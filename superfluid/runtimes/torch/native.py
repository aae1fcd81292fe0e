"""The native CPU kernels (kernels.c) as a kernel set for decoder.layer, when the runtime is
built with ``quant`` ("gguf": the file's own blocks; "q8_0" or "q4_1": requantized), and the route that picks between the two ways of
running it:

- op by op: decoder.run on ``NativeKernels`` (a layer is nine native calls instead of ~30
  torch ops);
- whole step: kernels.c's ``sf_decode``, the same kernels in the same order called from C,
  one call a step, on any step of the invariant (default) route and on decode-only steps of
  at most QROWS lanes otherwise. It is bit-identical to op by op (tests/test_whole_step.py,
  on every architecture feature), and refused where it cannot run a model
  (``kernels.decoder_refusal``: those steps go op by op).

Why the whole step stays (a second writing of the layer, in C): on a decode step the ops are
so small that a Python round trip per op is a large share of the step. Measured on
SmolLM2-135M Q4_1 (30 layers, q4_1, invariant route, 2 threads; Intel Xeon KVM, 2 cores,
AVX-512 VNNI; medians of 7 alternating repeats, load ~1): decode@1 5.5 ms a token whole-step
vs 7.3 ms op by op (1.34x), decode@8 17.5 vs 21.0 ms a step (1.20x), a 512-token prefill
517 vs 536 ms (even within noise: there the products dominate). See benchmarks/README.md.

- Products with at most ``QROWS`` rows (decode steps) use the quantized GEMV (weights
  quantized once at load, activations per block of 32 on entry); larger ones (prefill) keep
  the fp32 GEMM on the full-precision weights, where the step is compute-bound and
  quantization would buy nothing. Residual adds accumulate into the stream in place.
- A decode-only step attends in one native call per layer; other steps use the torch kernel.
- RoPE + the K/V store, RMS norm and SiLU-gating are one native call each.

Batch invariance. Every native kernel computes a row from that row alone, in a fixed order
(the GEMV's per-(row, output) dot, the per-query attention over the query's own keys in
position order, the per-row norm, RoPE and gate), so a row's result cannot depend on what
shares its step. Only the *route* can (QROWS: fp32 GEMM or torch attention for big steps).
With ``deterministic`` the route is fixed instead: every product takes the quantized GEMV
and every query the native attention, whatever the step — a batch-invariant mode that
costs little (see benchmarks/runtime_step.py --deterministic).
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .attention import StepMeta, attend
from .decoder import Experts, experts, run

QROWS = 32  # products with more rows than this run as fp32 GEMMs (crossover measured at 32-64)
WHOLE_STEP = True  # steps in one sf_decode call where the route allows (False: op by op; tests compare the two)
QUANT_KINDS = ("gguf", "q8_0", "q4_1")  # gguf: each matrix in the file's own blocks (quantized.py)


def require(quant: str, device: torch.device) -> None:
    """Raise ValueError unless the native quantized path can run here."""
    if quant not in QUANT_KINDS:
        raise ValueError(f"unknown quant {quant!r}; one of {', '.join(QUANT_KINDS)}")
    if device.type != "cpu":
        raise ValueError(f"quant={quant} runs the native CPU kernels; device is {device}")
    if kernels.native() is None:
        raise ValueError(f"quant={quant} needs the native kernels, which could not be built: {kernels.native_error()}")


def row_limit(deterministic: bool) -> float:
    """Products with more rows than this take the fp32 GEMM (never, when deterministic)."""
    return math.inf if deterministic else QROWS


def linear(x: torch.Tensor, m, b: torch.Tensor | None = None, qrows: float = QROWS) -> torch.Tensor:
    if m.q is not None and x.shape[0] <= qrows:
        out = kernels.gemv(x.contiguous(), m.q)
        return out.add_(b) if b is not None else out
    return torch.nn.functional.linear(x, m.w, b)


def add_linear(x: torch.Tensor, y: torch.Tensor, m, qrows: float = QROWS) -> torch.Tensor:
    """x + y W^T; in place on x (contiguous fp32, owned by the forward) on the native route."""
    if m.q is not None and y.shape[0] <= qrows:
        return kernels.gemv(y.contiguous(), m.q, out=x, accumulate=True)
    return x + torch.nn.functional.linear(y, m.w)


def _query_keys(meta: StepMeta, window: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row, once per step and window (every layer with that window reads it): its key
    cells [T, L] (its feed's row of the gather), the first key it sees and its key count
    (position + 1). The gather is built by the runtime from its own block tables, so its
    cells are in range."""
    if meta.native_keys is None:
        meta.native_keys = {}
    keys = meta.native_keys.get(window)
    if keys is None:
        if meta.decode_only:
            gather = meta.gather
        else:
            feed = torch.repeat_interleave(torch.arange(len(meta.q_lens)), torch.tensor(meta.q_lens))
            gather = meta.gather.index_select(0, feed)
        lens = (meta.positions + 1).contiguous()
        first = (lens - window).clamp_min(0) if window is not None else torch.zeros_like(lens)
        keys = meta.native_keys[window] = (gather, first.contiguous(), lens)
    return keys


def attend_native(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: StepMeta,
                  window: int | None, every_row: bool, softcap: float | None = None) -> torch.Tensor:
    """Decode-only steps (or, with every_row, any step) on the native attention, each query
    row over its own keys; the rest, and soft-capped scores (which the native kernel does not
    compute), on the torch kernel."""
    if softcap is not None or not (meta.decode_only or every_row):
        return attend(q, kc, vc, meta, window=window, softcap=softcap)
    return kernels.attend_decode(q, kc, vc, *_query_keys(meta, window), check_cells=False)


class NativeKernels:
    """decoder.Kernels on the native kernels for one step (model: a Llama built with quant)."""

    def __init__(self, model, meta: StepMeta):
        cfg = model.cfg
        self.meta, self.qrows, self.invariant = meta, model.qrows, model.deterministic
        self.H, self.eps = cfg.n_heads, cfg.rms_eps
        self.ropes = model.ropes

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x.contiguous(), w, self.eps)

    def linear(self, x: torch.Tensor, m, b: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x, m, b, self.qrows)

    def add_linear(self, x: torch.Tensor, y: torch.Tensor, m) -> torch.Tensor:
        return add_linear(x, y, m, self.qrows)

    def rope_store(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rope: int | None) -> torch.Tensor:
        if rope is not None:
            cos, sin = self.ropes[rope]
            return kernels.rope_kv(qkv.contiguous(), cos, sin, self.meta.positions, self.meta.slots, kc, vc, self.H)
        T, H, Hkv, d = qkv.shape[0], self.H, kc.shape[1], kc.shape[2]  # a layer without RoPE: store only
        kc.index_copy_(0, self.meta.slots, qkv[:, H * d: (H + Hkv) * d].reshape(T, Hkv, d))
        vc.index_copy_(0, self.meta.slots, qkv[:, (H + Hkv) * d:].reshape(T, Hkv, d))
        return qkv[:, : H * d].reshape(T, H, d)

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int | None,
               softcap: float | None) -> torch.Tensor:
        return attend_native(q.contiguous(), kc, vc, self.meta, window, self.invariant, softcap)

    def gate(self, gu: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        if activation == "silu" and (gu.shape[0] <= QROWS or self.invariant):
            return kernels.silu_mul(gu)
        g, u = gu.chunk(2, dim=-1)  # prefill, or GELU: torch's multi-threaded elementwise ops
        act = torch.nn.functional.silu(g) if activation == "silu" else torch.nn.functional.gelu(g, approximate="tanh")
        return act * u

    def experts(self, h: torch.Tensor, E: Experts, activation: str) -> torch.Tensor:
        """sf_experts (the quantized GEMV for every expert's rows, as sf_decode runs it) where
        those products would be quantized anyway; else the description on these kernels."""
        if activation == "silu" and (h.shape[0] <= QROWS or self.invariant) and kernels.experts_runnable(E):
            return kernels.experts(h.contiguous(), E)
        return experts(self, h, E, activation)


def whole_step(model, kv_k: torch.Tensor, kv_v: torch.Tensor) -> kernels.Decoder | None:
    """sf_decode's view of the model and this KV pool, built once per pool; None where
    sf_decode refuses the model (``kernels.decoder_refusal``): then every step goes op by op."""
    key = (kv_k.data_ptr(), kv_v.data_ptr())  # a reallocated pool needs a new view
    if model.native_decoder is None or model.native_decoder[0] != key:
        refused = kernels.decoder_refusal(model, kv_k, kv_v)
        model.native_decoder = (key, None if refused else kernels.Decoder(model, kv_k, kv_v))
    return model.native_decoder[1]


@torch.inference_mode()
def forward(model, x: torch.Tensor, meta: StepMeta, kv_k: torch.Tensor, kv_v: torch.Tensor) -> torch.Tensor:
    """Llama.forward on the native kernels: embeddings x [T, D] (ours: the residual adds go
    into it) -> final-normed hidden [T, D]. The whole step is one sf_decode call on any step
    of the invariant route (prefill chunks and draft verification too: sf_decode stores every
    row's k/v before any row attends, and each row sees its own keys up to its position) and
    on decode-only steps of <= QROWS; else decoder.run on NativeKernels."""
    if WHOLE_STEP and (model.deterministic or (meta.decode_only and x.shape[0] <= QROWS)):
        dec = whole_step(model, kv_k, kv_v)
        if dec is not None:
            return dec(x, meta.positions, meta.slots, *_query_keys(meta, model.cfg.sliding_window))
    return run(NativeKernels(model, meta), model.layers, model.norm, x, kv_k, kv_v, model.options)
