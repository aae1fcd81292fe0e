"""The Llama-family decoder (Llama, SmolLM2, Qwen2, Mistral) over packed tokens: its
weights, RoPE tables and the torch kernel set.

One ``forward`` runs every feed of a step: x is [T, D] for T packed tokens of any number
of sequences; attention finds each token's keys through the StepMeta. Weights are fused
once at load: wqkv [(H + 2 Hkv) d, D] and wgu [2 F, D], so a layer is four matmuls. The
layer itself is decoder.layer; here it runs on ``TorchKernels``, or with ``quant`` on the
native route (native.py).
"""

from __future__ import annotations

import math

from functools import partial

import torch
import torch.nn.functional as F

from . import native
from .attention import StepMeta, attend, attend_fixed
from .config import ModelConfig
from .decoder import Experts, Layer, Options, experts, run
from .qmat import QMat
from .quantized import FILE_ROUTE, Src, route_label

ROW_BLOCK = 16  # deterministic mode: every matmul runs on [ROW_BLOCK, K] row blocks


class Mat:
    """A weight matrix [out, in] in the compute dtype, and optionally a bf16 copy used for
    single-row products (CPUs without native bf16: there a bf16 GEMV streams half the bytes,
    while bf16 GEMMs with more rows are emulated and far slower), or a block-quantized copy
    for the native kernels' decode-sized products (``quant``; ``src``: the matrix's source,
    with the file's blocks where it has them: quantized.py)."""

    __slots__ = ("_w", "w16", "q")

    def __init__(self, w: torch.Tensor, gemv16: bool, quant: str | None = None, src: Src | None = None,
                 keep_float: bool = True):
        self.w16 = w.to(torch.bfloat16).contiguous() if gemv16 and not quant else None
        self.q = (src or Src.of(w)).qmat(quant) if quant else None
        # Where every product runs on the native kernels (keep_float False: the default route)
        # the float copy is never read, and it is 4 bytes a weight (a 1B model's 5 GB): not held.
        self._w = w if keep_float or self.q is None else None

    @property
    def w(self) -> torch.Tensor:
        """The float weights; on the all-native route the kernel's own weights, dequantized when asked."""
        return self._w if self._w is not None else self.q.dequantize()


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
                 quant: str | None = None, positions: int | None = None, blocks: dict | None = None):
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
        # meta: a matrix the loader gave no floats (only its blocks feed products: load_gguf)
        put = lambda t: t if t.is_meta else t.to(device=device, dtype=dtype).contiguous()  # noqa: E731
        blocks = blocks or {}
        src = lambda key: Src.of(tensors[key], blocks.get(key))  # noqa: E731
        keep = not quant or self.qrows != math.inf  # else no product reads a matrix's floats
        mat = lambda s: Mat(put(s.w), gemv16, quant, s, keep)  # noqa: E731
        embed = put(tensors["embed"])  # [V, D]
        self.norm = put(tensors["norm"])
        # On the file's route the LM head is in the file's own type (llama.cpp's 4-bit files
        # keep it wider). Requantized, it stays at 8 bits under q4_1: 4 bits there cost far
        # more accuracy than time.
        head_quant = (FILE_ROUTE if quant == FILE_ROUTE else "q8_0") if quant else None
        head = "embed" if cfg.tie_embeddings else "lm_head"
        self.lm_head = Mat(embed if cfg.tie_embeddings else put(tensors["lm_head"]), gemv16, head_quant,
                           src(head), keep)  # [V, D]
        # The embedding table: where the loader gave it no floats (a large table on the file's
        # all-native route: load_gguf, quantized.EMBED_FLOATS_MAX) its rows are gathered from the
        # file's own blocks (QMat.rows: the same floats, 0.5-1 byte a weight instead of 4);
        # else the float table.
        self.embed_q = self._embed_blocks(cfg, src("embed")) if embed.is_meta else None
        self.embed = None if self.embed_q is not None else embed
        self.layers = [self._layer(cfg, tensors, i, put, mat, src) for i in range(cfg.n_layers)]
        # the native route's name: the types its matrices run in ("Q4_K+Q6_K", "F16>q8_0")
        self.route = route_label([m.q for L in self.layers for m in _mats(L)] + [self.lm_head.q]) if quant else None
        self.options = Options(q_scale=cfg.attn_scale * cfg.head_dim ** 0.5 if cfg.attn_scale else 1.0,
                               residual_scale=cfg.residual_scale, activation=cfg.activation, softcap=cfg.attn_softcap)
        # RoPE tables [positions, d] in float32, as transformers computes them (one product each):
        # table 0 for every rotating layer, table 1 for sliding layers with their own base (Gemma 3).
        # Tables only as long as the runtime serves (positions): a file's context_length may
        # be huge (or corrupt), and a table of it would be allocated for nothing.
        n_pos = min(cfg.max_position, positions or cfg.max_position)
        self.ropes = [self._rope_table(cfg, tensors.get("rope_freqs"), n_pos, device, dtype, local=False)]
        if cfg.local_rope_theta is not None:
            self.ropes.append(self._rope_table(cfg, None, n_pos, device, dtype, local=True))
        self.cos, self.sin = self.ropes[0]  # sf_decode's table (it runs models with one)
        self.deterministic = deterministic
        self.linear = linear_fixed if deterministic else linear
        self.attend = attend_fixed if deterministic else attend
        if quant:  # the LM head's decode-sized products on the native kernels too
            self.linear = partial(native.linear, qrows=self.qrows)

    def _embed_blocks(self, cfg: ModelConfig, s: Src) -> QMat:
        q = self.lm_head.q if cfg.tie_embeddings else s.qmat(FILE_ROUTE)
        if not isinstance(q, QMat) or q.source is None:  # the loader only drops floats a kernel's blocks hold
            raise ValueError("the embedding table has neither floats nor blocks a kernel reads")
        return q

    def embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of tokens [T] (in range: the runtime checks ids) -> [T, D]."""
        return self.embed_q.rows(tokens) if self.embed_q is not None else self.embed.index_select(0, tokens)

    @staticmethod
    def _layer(cfg: ModelConfig, tensors: dict[str, torch.Tensor], i: int, put, mat, src) -> Layer:
        p = f"layers.{i}."
        t = lambda name: tensors[p + name]  # noqa: E731
        s = lambda name: src(p + name)  # noqa: E731
        opt = lambda name: put(tensors[p + name]) if p + name in tensors else None  # noqa: E731
        q, k = s("q"), s("k")
        q_norm, k_norm = tensors.get(p + "q_norm"), tensors.get(p + "k_norm")
        if cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim:
            # Partial rotary as full-head rotate-half: the rotated and passed dims of each q/k
            # head interleaved so that the full-head pairs (i, i + d/2) are the rotated pairs
            # (i, i + r/2) and passed dims pair with passed dims at frequency 0 (cos 1, sin 0:
            # untouched). q and k permuted alike leave every q.k, so attention, unchanged.
            perm = _partial_rotary_perm(cfg.head_dim, cfg.rotary_dim)
            q, k = q.rows(lambda w: _permute_heads(w, perm)), k.rows(lambda w: _permute_heads(w, perm))
            if q_norm is not None and q_norm.shape[0] == cfg.head_dim:
                q_norm, k_norm = q_norm[perm], k_norm[perm]
            elif q_norm is not None:
                q_norm, k_norm = _permute_heads(q_norm[:, None], perm)[:, 0], _permute_heads(k_norm[:, None], perm)[:, 0]
        bias = torch.cat([t("q_bias"), t("k_bias"), t("v_bias")]) if cfg.attention_bias else None
        if bias is not None and cfg.rotary_dim is not None and cfg.rotary_dim < cfg.head_dim:
            raise ValueError("q/k bias with partial rotary is not supported")
        experts = None
        if cfg.n_experts:
            gate, up, down = s("gate_exps"), s("up_exps"), s("down_exps")
            experts = Experts(router=mat(s("router")), used=cfg.n_experts_used, renormalise=cfg.moe_norm_topk,
                              wgu=[mat(Src.cat(gate[e], up[e])) for e in range(cfg.n_experts)],
                              wdown=[mat(down[e]) for e in range(cfg.n_experts)])
        return Layer(
            attn_norm=opt("attn_norm"), wqkv=mat(Src.cat(q, k, s("v"))),
            bqkv=put(bias) if bias is not None else None, wo=mat(s("o")), ffn_norm=opt("ffn_norm"),
            wgu=None if experts else mat(Src.cat(s("gate"), s("up"))), wdown=None if experts else mat(s("down")),
            q_norm=put(q_norm) if q_norm is not None else None, k_norm=put(k_norm) if k_norm is not None else None,
            post_attn_norm=opt("post_attn_norm"), post_ffn_norm=opt("post_ffn_norm"),
            rope=(1 if cfg.uses_local_rope(i) else 0) if cfg.rotates(i) else None, window=cfg.window(i),
            experts=experts,
        )

    @staticmethod
    def _rope_table(cfg: ModelConfig, rope_freqs, n_pos: int, device, dtype, local: bool):
        inv, scale = cfg.rope(rope_freqs, local=local, positions=n_pos)  # scale: YaRN's / LongRoPE's attention factor (else 1)
        passed = cfg.head_dim // 2 - inv.shape[0]  # partial rotary: frequency 0 for the passed pairs
        pos = torch.arange(n_pos, dtype=torch.float32)
        freqs = pos[:, None] * inv[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos() * scale, emb.sin() * scale
        if passed:  # rotated dims first in each half (_partial_rotary_perm); passed ones exactly kept
            one, zero = torch.ones(n_pos, passed), torch.zeros(n_pos, passed)
            r = inv.shape[0]
            cos = torch.cat([cos[:, :r], one, cos[:, r:], one], dim=-1)
            sin = torch.cat([sin[:, :r], zero, sin[:, r:], zero], dim=-1)
        return cos.to(device, dtype).contiguous(), sin.to(device, dtype).contiguous()

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
        x = self.embed_rows(tokens)  # [T, D]
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)  # as Gemma: the scale in the model dtype
        if self.quant:
            return native.forward(self, x, meta, kv_k, kv_v)
        return run(TorchKernels(self, meta), self.layers, self.norm, x, kv_k, kv_v, self.options)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [R, D] -> [R, V] float32."""
        out = self.linear(hidden, self.lm_head).float()
        if self.cfg.logit_scale != 1.0:
            out = out / self.cfg.logit_scale
        if self.cfg.final_softcap is not None:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out


class TorchKernels:
    """decoder.Kernels on torch ops for one step: the model's linear (plain, bf16 GEMV or
    fixed row blocks) and attention (fast or batch-invariant), RoPE at the step's positions."""

    def __init__(self, model: Llama, meta: StepMeta):
        cfg = model.cfg
        self.H, self.Hkv, self.d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.meta = meta
        self.norm, self.linear, self._attend = model.rms_norm, model.linear, model.attend
        # Each table at the step's positions, [T, 1, d], once per step.
        self.tables = [(c.index_select(0, meta.positions)[:, None], s.index_select(0, meta.positions)[:, None])
                       for c, s in model.ropes]

    def add_linear(self, x: torch.Tensor, y: torch.Tensor, m: Mat) -> torch.Tensor:
        return x + self.linear(y, m)

    def rope_store(self, qkv: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, rope: int | None) -> torch.Tensor:
        T, H, Hkv, d = qkv.shape[0], self.H, self.Hkv, self.d
        qk = qkv[:, : (H + Hkv) * d].view(T, H + Hkv, d)
        if rope is not None:
            qk = Llama.rope(qk, *self.tables[rope])  # q and k heads at once
        kc.index_copy_(0, self.meta.slots, qk[:, H:])
        vc.index_copy_(0, self.meta.slots, qkv[:, (H + Hkv) * d:].view(T, Hkv, d))
        return qk[:, :H]

    def attend(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, window: int | None,
               softcap: float | None) -> torch.Tensor:
        return self._attend(q, kc, vc, self.meta, window=window, softcap=softcap)

    @staticmethod
    def gate(gu: torch.Tensor, activation: str = "silu") -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        return activate(g, activation) * u

    def experts(self, h: torch.Tensor, E: Experts, activation: str) -> torch.Tensor:
        return experts(self, h, E, activation)


def activate(g: torch.Tensor, activation: str) -> torch.Tensor:
    return F.silu(g) if activation == "silu" else F.gelu(g, approximate="tanh")


def _partial_rotary_perm(d: int, r: int) -> torch.Tensor:
    """New head dim -> old: [rot first half, passed first half, rot second half, passed second half]."""
    half, rh, ph = d // 2, r // 2, (d - r) // 2
    return torch.cat([torch.arange(rh), torch.arange(r, r + ph), torch.arange(rh, r), torch.arange(r + ph, d)])


def _permute_heads(w: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Rows of w [heads * d, ...] permuted within each head."""
    d = perm.shape[0]
    return w.reshape(-1, d, *w.shape[1:])[:, perm].reshape(w.shape)


def _mats(layer: Layer) -> list[Mat]:
    experts = layer.experts
    mats = [layer.wqkv, layer.wo] + ([layer.wgu, layer.wdown] if experts is None else [])
    return mats + ([experts.router] + experts.wgu + experts.wdown if experts is not None else [])
