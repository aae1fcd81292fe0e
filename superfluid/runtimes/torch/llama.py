"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over packed tokens: its
weights, RoPE tables and the torch kernel set.

One ``forward`` runs every feed of a step: x is [T, D] for T packed tokens of any number
of sequences; attention finds each token's keys through the StepMeta. Weights are fused
once at load: wqkv [(H + 2 Hkv) d, D] and wgu [2 F, D], so a layer is four matmuls. The
layer itself is decoder.layer; here it runs on ``TorchKernels``, or with ``quant`` on the
native route (native.py).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from . import native
from .attention import StepMeta, attend, attend_fixed
from .config import ModelConfig
from .decoder import Layer, run
from .kernels import QMat

ROW_BLOCK = 16  # deterministic mode: every matmul runs on [ROW_BLOCK, K] row blocks


class Mat:
    """A weight matrix [out, in] in the compute dtype, and optionally a bf16 copy used for
    single-row products (CPUs without native bf16: there a bf16 GEMV streams half the bytes,
    while bf16 GEMMs with more rows are emulated and far slower), or a block-quantized copy
    for the native kernels' decode-sized products (``quant``)."""

    __slots__ = ("w", "w16", "q")

    def __init__(self, w: torch.Tensor, gemv16: bool, quant: str | None = None):
        self.w = w
        self.w16 = w.to(torch.bfloat16).contiguous() if gemv16 and not quant else None
        self.q = QMat(w, quant) if quant else None


def linear(x: torch.Tensor, m: Mat, b: torch.Tensor | None = None) -> torch.Tensor:
    if m.w16 is not None and x.shape[0] == 1:
        out = F.linear(x.to(torch.bfloat16), m.w16).to(x.dtype)
        return out + b if b is not None else out
    return F.linear(x, m.w, b)


def linear_fixed(x: torch.Tensor, m: Mat, b: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T in fixed [ROW_BLOCK, K] blocks, so a row's result never depends on the others:
    BLAS picks kernels (and reduction orders) by the shape, and here the shape never changes."""
    T = x.shape[0]
    pad = -T % ROW_BLOCK
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    out = torch.cat([F.linear(blk, m.w) for blk in x.split(ROW_BLOCK)])[:T]
    return out + b if b is not None else out


class Llama:
    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device, deterministic: bool = False, native_bf16: bool = True,
                 quant: str | None = None, positions: int | None = None):
        # bf16 asked of a CPU without native bf16: compute in fp32, bf16 copies for GEMV.
        gemv16 = dtype == torch.bfloat16 and device.type == "cpu" and not native_bf16 and not deterministic
        if dtype == torch.bfloat16 and device.type == "cpu" and not native_bf16:
            dtype = torch.float32
        if quant:
            native.require(quant, device)
            if dtype != torch.float32:
                raise ValueError(f"quant={quant} computes in float32; dtype {dtype} asked")
        self.cfg, self.dtype, self.device, self.quant = cfg, dtype, device, quant
        self.native_decoder = None  # quant: (KV pool, sf_decode view or None if refused), native.whole_step builds it
        self.qrows = native.row_limit(deterministic)  # quant: products up to this many rows are quantized
        put = lambda t: t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        mat = lambda t: Mat(put(t), gemv16, quant)  # noqa: E731
        self.embed = put(tensors["embed"])  # [V, D]
        self.norm = put(tensors["norm"])
        # The LM head stays at 8 bits under q4_1 (as llama.cpp's 4-bit files keep the output
        # matrix at higher precision): 4-bit there costs far more accuracy than time.
        head_quant = "q8_0" if quant else None
        self.lm_head = Mat(self.embed, gemv16, head_quant) if cfg.tie_embeddings else \
            Mat(put(tensors["lm_head"]), gemv16, head_quant)  # [V, D]
        self.layers: list[Layer] = []
        for i in range(cfg.n_layers):
            p = f"layers.{i}."
            t = lambda name: tensors[p + name]  # noqa: E731
            bias = torch.cat([t("q_bias"), t("k_bias"), t("v_bias")]) if cfg.attention_bias else None
            self.layers.append(Layer(
                attn_norm=put(t("attn_norm")), wqkv=mat(torch.cat([t("q"), t("k"), t("v")])),
                bqkv=put(bias) if bias is not None else None, wo=mat(t("o")), ffn_norm=put(t("ffn_norm")),
                wgu=mat(torch.cat([t("gate"), t("up")])), wdown=mat(t("down")),
            ))
        inv, scale = cfg.rope(tensors.get("rope_freqs"))  # scale: YaRN's attention factor (else 1)
        # RoPE tables [max_position, d] in float32, as transformers computes them (one product each).
        # Tables only as long as the runtime serves (positions): a file's context_length may
        # be huge (or corrupt), and a table of it would be allocated for nothing.
        pos = torch.arange(min(cfg.max_position, positions or cfg.max_position), dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos, self.sin = (emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype)
        self.deterministic = deterministic
        self.linear = linear_fixed if deterministic else linear
        self.attend = partial(attend_fixed if deterministic else attend, window=cfg.sliding_window)
        if quant:  # the LM head's decode-sized products on the native kernels too
            self.linear = partial(native.linear, qrows=self.qrows)

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # As transformers: the statistics in float32, scaled by the weight in the model dtype.
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, self.cfg.rms_eps)  # one fused op
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [T, heads, d]; cos, sin: [T, 1, d]; rotate-half convention.
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, meta: StepMeta, kv_k: torch.Tensor, kv_v: torch.Tensor) -> torch.Tensor:
        """tokens: [T] int64. kv_k, kv_v: [n_layers, S, Hkv, d] (this step's cells get written).
        Returns the final-normed hidden states [T, D]."""
        x = self.embed.index_select(0, tokens)  # [T, D]
        if self.quant:
            return native.forward(self, x, meta, kv_k, kv_v)
        return run(TorchKernels(self, meta), self.layers, self.norm, x, kv_k, kv_v)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, D] -> [R, V] float32."""
        return self.linear(hidden, self.lm_head).float()


class TorchKernels:
    """decoder.Kernels on torch ops for one step: the model's linear (plain, bf16 GEMV or
    fixed row blocks) and attention (fast or batch-invariant), RoPE at the step's positions."""

    def __init__(self, model: Llama, meta: StepMeta):
        cfg = model.cfg
        self.H, self.Hkv, self.d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.meta = meta
        self.norm, self.linear, self._attend = model.rms_norm, model.linear, model.attend
        self.cos = model.cos.index_select(0, meta.positions)[:, None]  # [T, 1, d]
        self.sin = model.sin.index_select(0, meta.positions)[:, None]

    def add_linear(self, x: torch.Tensor, y: torch.Tensor, m: Mat) -> torch.Tensor:
        return x + self.linear(y, m)

    def rope_store(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        T, H, Hkv, d = qkv.shape[0], self.H, self.Hkv, self.d
        qk = Llama.rope(qkv[:, : (H + Hkv) * d].view(T, H + Hkv, d), self.cos, self.sin)  # q and k heads at once
        kc.index_copy_(0, self.meta.slots, qk[:, H:])
        vc.index_copy_(0, self.meta.slots, qkv[:, (H + Hkv) * d:].view(T, Hkv, d))
        return qk[:, :H]

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        return self._attend(q, kc, vc, self.meta)

    @staticmethod
    def gate(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return F.silu(g) * u
