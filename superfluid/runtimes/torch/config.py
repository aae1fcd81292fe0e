"""ModelConfig: the shape of a decoder-only transformer, whatever file it came from.

One forward (decoder.py) runs every architecture here; an architecture is a set of the
named options below, each off by default (a plain Llama):

- ``qk_norm``: RMS norm of q and k before RoPE, per head ("head": Qwen3, Gemma 3) or over
  all heads at once ("full": OLMo 2, OLMoE);
- ``pre_norm`` / ``post_norm``: the norm before attention and feed-forward (off in OLMo 2),
  a norm of each sublayer's output before the residual add (Gemma 2/3, OLMo 2);
- ``activation``: the gating function (SiLU, or GELU-tanh for Gemma's GeGLU);
- ``embed_scale``, ``residual_scale``, ``attn_scale``, ``logit_scale``: the multipliers of
  Gemma (sqrt(D) on embeddings, query_pre_attn_scalar) and Granite;
- ``attn_softcap`` / ``final_softcap``: cap * tanh(x / cap) on attention scores and logits
  (Gemma 2);
- ``layer_sliding``: which layers slide (Gemma 2/3 alternate; None: all, if a window is set);
  ``local_rope_theta``: the RoPE base of sliding layers (Gemma 3);
- ``layer_rope``: which layers rotate (SmolLM3 leaves every fourth unrotated);
- ``rotary_dim``: partial rotary (Phi-4-mini rotates the first 3/4 of each head);
- ``n_experts`` / ``n_experts_used`` / ``moe_norm_topk``: a mixture-of-experts feed-forward
  (Qwen3-MoE, OLMoE, Mixtral): softmax over the router, the top k, optionally renormalised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "smollm3",
                 "olmo2", "olmoe", "granite", "mixtral")  # all share one forward (module doc)


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "llama3" | "yarn" | "longrope"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn: rotations per original context above which a frequency is kept
    beta_slow: float = 1.0  # yarn: ... below which it is divided by factor (a linear ramp between)
    attention_factor: float | None = None  # yarn: multiplies cos and sin; None: yarn_mscale(factor)
    truncate: bool = True  # yarn: round the ramp's ends outward to whole dimensions
    short_factors: tuple[float, ...] | None = None  # longrope: per-frequency divisors within the original context
    long_factors: tuple[float, ...] | None = None  # ... and beyond it


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context ``scale`` times the original (transformers' get_mscale)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    attention_bias: bool = False  # q/k/v bias (qwen2)
    tie_embeddings: bool = True
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None  # a query at position p sees keys at p - window < pos <= p
    # The architecture options (module doc); each default is the plain Llama.
    qk_norm: str | None = None  # "head" | "full"
    pre_norm: bool = True
    post_norm: bool = False
    activation: str = "silu"  # "silu" | "gelu_tanh"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    logit_scale: float = 1.0  # logits are divided by it (Granite's logits_scaling)
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_sliding: tuple[bool, ...] | None = None  # None: every layer slides when sliding_window is set
    local_rope_theta: float | None = None  # sliding layers' RoPE base, unscaled (None: as the others)
    layer_rope: tuple[bool, ...] | None = None  # None: every layer rotates
    rotary_dim: int | None = None  # None: the whole head
    n_experts: int = 0  # 0: a dense feed-forward
    n_experts_used: int = 0
    moe_norm_topk: bool = False

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        for name in ("layer_sliding", "layer_rope"):
            v = getattr(self, name)
            if v is not None and len(v) != self.n_layers:
                raise ValueError(f"{name} has {len(v)} entries for {self.n_layers} layers")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary dimension {self.rotary_dim} is not an even number in (0, {self.head_dim}]")
        if self.n_experts and not 0 < self.n_experts_used <= self.n_experts:
            raise ValueError(f"{self.n_experts_used} experts used of {self.n_experts}")
        if self.qk_norm not in (None, "head", "full") or self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"unknown option qk_norm={self.qk_norm!r} / activation={self.activation!r}")

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer (None: full attention)."""
        if self.sliding_window is None or (self.layer_sliding is not None and not self.layer_sliding[layer]):
            return None
        return self.sliding_window

    def rotates(self, layer: int) -> bool:
        return self.layer_rope is None or self.layer_rope[layer]

    def uses_local_rope(self, layer: int) -> bool:
        """Sliding layers with their own RoPE base take the second table (Gemma 3)."""
        return self.local_rope_theta is not None and self.window(layer) is not None

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def rope(self, rope_freqs: torch.Tensor | None = None, local: bool = False,
             positions: int | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq [rotary_dim // 2] float32, attention_factor): the rotary frequencies with
        scaling applied and the factor cos and sin are multiplied by, as transformers' rope init
        functions compute them (same float32 operations, so the tables match bit for bit).
        ``local``: the sliding layers' table (local_rope_theta, never scaled). LongRoPE takes its
        long factors when the runtime serves more ``positions`` than the original context
        (llama.cpp's choice, by the context; transformers switches per forward by the longest
        position, which a cache of keys rotated the other way cannot follow)."""
        d = self.rotary_dim or self.head_dim
        theta = self.local_rope_theta if local else self.rope_theta
        pos_freqs = theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        inv = 1.0 / pos_freqs
        if local:
            return inv, 1.0
        if rope_freqs is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
            return inv / rope_freqs.float(), 1.0
        s = self.rope_scaling
        if s is None:
            return inv, 1.0
        if s.kind == "longrope":  # Phi-3: per-frequency divisors, and sqrt(1 + ln(factor) / ln(original))
            long = positions is not None and positions > s.original_max_position
            ext = torch.tensor(s.long_factors if long else s.short_factors, dtype=torch.float32)
            attn = s.attention_factor
            if attn is None:
                attn = 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(s.original_max_position))
            return 1.0 / (ext * pos_freqs), attn
        if s.kind == "linear":
            return inv / s.factor, 1.0
        if s.kind == "llama3":
            low_wavelen = s.original_max_position / s.low_freq_factor
            high_wavelen = s.original_max_position / s.high_freq_factor
            wavelen = 2 * math.pi / inv
            out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            smoothed = (1 - smooth) * out / s.factor + smooth * out
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, out), 1.0
        if s.kind == "yarn":
            # Dimension pairs below `low` turn more than beta_fast times over the original context
            # and keep their frequency; those above `high` turn fewer than beta_slow times and are
            # interpolated (divided by factor); a linear ramp blends the pairs between.
            def corr_dim(rotations: float) -> float:
                turns = s.original_max_position / (rotations * 2 * math.pi)
                return d * math.log(turns) / (2 * math.log(self.rope_theta))
            low, high = corr_dim(s.beta_fast), corr_dim(s.beta_slow)
            if s.truncate:
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, d - 1)
            if low == high:
                high += 0.001  # as transformers: no division by zero
            ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
            keep = 1 - ramp  # weight of the unscaled frequency
            interp = 1.0 / (s.factor * pos_freqs)
            inv = interp * (1 - keep) + inv * keep
            return inv, s.attention_factor if s.attention_factor is not None else yarn_mscale(s.factor)
        raise ValueError(f"unsupported rope scaling {s.kind!r}")

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Canonical tensor name -> shape ([out, in] for matrices). Optional ones are listed
        by the loaders (lm_head when tied, biases without attention_bias)."""
        D, F = self.hidden, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"embed": (self.vocab_size, D), "norm": (D,)}
        if not self.tie_embeddings:
            shapes["lm_head"] = (self.vocab_size, D)
        for i in range(self.n_layers):
            p = f"layers.{i}."
            shapes |= {
                p + "q": (self.q_size, D),
                p + "k": (self.kv_size, D),
                p + "v": (self.kv_size, D),
                p + "o": (D, self.q_size),
            }
            if self.pre_norm:
                shapes |= {p + "attn_norm": (D,), p + "ffn_norm": (D,)}
            if self.post_norm:
                shapes |= {p + "post_attn_norm": (D,), p + "post_ffn_norm": (D,)}
            if self.qk_norm:
                full = self.qk_norm == "full"
                shapes |= {p + "q_norm": (self.q_size if full else self.head_dim,),
                           p + "k_norm": (self.kv_size if full else self.head_dim,)}
            if self.n_experts:  # experts stacked: [E, F, D] gate and up, [E, D, F] down
                E = self.n_experts
                shapes |= {p + "router": (E, D), p + "gate_exps": (E, F, D), p + "up_exps": (E, F, D),
                           p + "down_exps": (E, D, F)}
            else:
                shapes |= {p + "gate": (F, D), p + "up": (F, D), p + "down": (D, F)}
            if self.attention_bias:
                shapes |= {p + "q_bias": (self.q_size,), p + "k_bias": (self.kv_size,), p + "v_bias": (self.kv_size,)}
        return shapes


def check_shapes(cfg: ModelConfig, tensors: dict[str, torch.Tensor], source: str, names: dict[str, str]) -> None:
    """Every expected tensor is present with its shape; ``names`` maps canonical -> file names."""
    from ...models import ModelLoadError

    for key, shape in cfg.expected_shapes().items():
        if key not in tensors:
            raise ModelLoadError(f"{source}: missing tensor {names.get(key, key)!r}")
        got = tuple(tensors[key].shape)
        if got != shape:
            raise ModelLoadError(f"{source}: tensor {names.get(key, key)!r} has shape {list(got)}, expected {list(shape)}")
