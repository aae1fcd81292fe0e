"""Load a Hugging Face folder: config.json + *.safetensors -> (ModelConfig, fp32 tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ...models import ModelLoadError, check_size
from .config import ARCHITECTURES, ModelConfig, RopeScaling, check_shapes, yarn_mscale

_LAYER_NAMES = {  # HF suffix -> canonical suffix
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "q", "self_attn.k_proj.weight": "k",
    "self_attn.v_proj.weight": "v", "self_attn.q_proj.bias": "q_bias", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias", "self_attn.o_proj.weight": "o", "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "gate", "mlp.up_proj.weight": "up", "mlp.down_proj.weight": "down",
}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}


def hf_name(key: str) -> str:
    if key.startswith("layers."):
        _, idx, suffix = key.split(".", 2)
        return f"model.layers.{idx}." + next(h for h, c in _LAYER_NAMES.items() if c == suffix)
    return next(h for h, c in _GLOBAL_NAMES.items() if c == key)


def _rope_scaling(c: dict, path: Path) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes rope_parameters; older configs rope_theta + rope_scaling (which
    # transformers prefers when both are there).
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if kind == "llama3":
        return theta, RopeScaling("llama3", float(params["factor"]), float(params.get("low_freq_factor", 1.0)),
                                  float(params.get("high_freq_factor", 4.0)),
                                  int(params.get("original_max_position_embeddings", 8192)))
    if kind == "yarn":  # defaults as transformers' _compute_yarn_parameters and standardize_rope_params
        max_pos = int(c.get("max_position_embeddings", 2048))
        orig = int(params.get("original_max_position_embeddings") or max_pos)
        factor = float(params["factor"] if params.get("factor") is not None else max_pos / orig)
        attn = params.get("attention_factor")
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if attn is None and mscale and mscale_all_dim:
            attn = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        return theta, RopeScaling("yarn", factor, original_max_position=orig,
                                  beta_fast=float(params.get("beta_fast") or 32),
                                  beta_slow=float(params.get("beta_slow") or 1),
                                  attention_factor=float(attn) if attn is not None else None,
                                  truncate=bool(params.get("truncate", True)))
    raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r} (field rope_scaling)")


def _sliding_window(c: dict, arch: str, file: Path) -> int | None:
    """The window every layer uses, as transformers reads it (None: full attention)."""
    if arch == "mistral":
        window = c.get("sliding_window", 4096)  # MistralConfig's default when the key is absent; null: none
        return int(window) if window else None
    if arch == "qwen2" and c.get("use_sliding_window") and c.get("sliding_window"):
        # Qwen2Config: layers from max_window_layers on slide (unless layer_types says otherwise).
        n, first = int(c["num_hidden_layers"]), int(c.get("max_window_layers", 28))
        types = c.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        sliding = {t == "sliding_attention" for t in types}
        if sliding == {True}:
            return int(c["sliding_window"])
        if sliding == {True, False}:
            raise ModelLoadError(f"{file}: sliding window on some layers only is not supported "
                                 "(fields layer_types / max_window_layers)")
    return None


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")


def read_config(path: Path) -> ModelConfig:
    file = path / "config.json"
    try:
        c = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file}: unreadable ({e})") from e
    arch = c.get("model_type")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{file}: unsupported architecture {arch!r} (field model_type); supported: {', '.join(ARCHITECTURES)}")
    for name in _SIZES:
        if c.get(name) is not None:
            check_size(name, c[name], str(file))
    try:
        n_heads = int(c["num_attention_heads"])
        theta, scaling = _rope_scaling(c, file)
        window = _sliding_window(c, arch, file)
        return ModelConfig(
            arch=arch, vocab_size=int(c["vocab_size"]), hidden=int(c["hidden_size"]),
            intermediate=int(c["intermediate_size"]), n_layers=int(c["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // n_heads),
            rope_theta=theta, rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position=int(c.get("max_position_embeddings", 2048)),
            attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            rope_scaling=scaling, sliding_window=window,
        )
    except KeyError as e:
        raise ModelLoadError(f"{file}: missing field {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelLoadError(f"{file}: bad field value ({e})") from e


def load_hf(path: Path, progress: bool = False) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    path = Path(path)
    cfg = read_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors files")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    key = _GLOBAL_NAMES.get(name)
                    if key is None and name.startswith("model.layers."):
                        idx, suffix = name[len("model.layers."):].split(".", 1)
                        if suffix in _LAYER_NAMES and idx.isdigit():
                            key = f"layers.{idx}.{_LAYER_NAMES[suffix]}"
                    if key is not None:
                        out[key] = f.get_tensor(name).float().contiguous()
                        if not torch.isfinite(out[key]).all():  # a NaN weight poisons every row
                            raise ModelLoadError(f"{file}: tensor {name!r} holds NaN or infinite values")
        except ModelLoadError:
            raise
        except Exception as e:  # truncated or corrupt safetensors
            raise ModelLoadError(f"{file}: unreadable safetensors ({type(e).__name__}: {e})") from e
    if cfg.tie_embeddings:
        out.pop("lm_head", None)
    check_shapes(cfg, out, str(path), {k: hf_name(k) for k in cfg.expected_shapes()})
    return cfg, out
