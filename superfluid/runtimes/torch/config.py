"""ModelConfig: the shape of a Llama-family decoder, whatever file it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")  # all share one forward; qwen2 adds q/k/v bias


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "llama3" | "yarn"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3, yarn: the pretraining context
    beta_fast: float = 32.0  # yarn: rotations per original context above which a frequency is kept
    beta_slow: float = 1.0  # yarn: ... below which it is divided by factor (a linear ramp between)
    attention_factor: float | None = None  # yarn: multiplies cos and sin; None: yarn_mscale(factor)
    truncate: bool = True  # yarn: round the ramp's ends outward to whole dimensions


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

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def rope(self, rope_freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq [head_dim // 2] float32, attention_factor): the rotary frequencies with
        scaling applied and the factor cos and sin are multiplied by, as transformers' rope init
        functions compute them (same float32 operations, so the tables match bit for bit)."""
        d = self.head_dim
        pos_freqs = self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
        inv = 1.0 / pos_freqs
        if rope_freqs is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
            return inv / rope_freqs.float(), 1.0
        s = self.rope_scaling
        if s is None:
            return inv, 1.0
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
                p + "attn_norm": (D,),
                p + "q": (self.q_size, D),
                p + "k": (self.kv_size, D),
                p + "v": (self.kv_size, D),
                p + "o": (D, self.q_size),
                p + "ffn_norm": (D,),
                p + "gate": (F, D),
                p + "up": (F, D),
                p + "down": (D, F),
            }
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
