"""ModelConfig: the shape of a Llama-family decoder, whatever file it came from."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")  # all share one forward; qwen2 adds q/k/v bias


@dataclass(frozen=True)
class RopeScaling:
    kind: str  # "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only


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
    sliding_window: int | None = None  # mistral: the context is capped at the window

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    @property
    def q_size(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_kv_heads * self.head_dim

    def inv_freq(self, rope_freqs: torch.Tensor | None = None) -> torch.Tensor:
        """[head_dim // 2] float32 rotary frequencies, with scaling applied (as transformers)."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if rope_freqs is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
            return inv / rope_freqs.float()
        s = self.rope_scaling
        if s is None:
            return inv
        if s.kind == "linear":
            return inv / s.factor
        if s.kind == "llama3":
            low_wavelen = s.original_max_position / s.low_freq_factor
            high_wavelen = s.original_max_position / s.high_freq_factor
            wavelen = 2 * math.pi / inv
            out = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
            smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
            smoothed = (1 - smooth) * out / s.factor + smooth * out
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, out)
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
