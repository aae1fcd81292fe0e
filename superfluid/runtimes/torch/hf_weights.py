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
    "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
    "post_feedforward_layernorm.weight": "post_ffn_norm", "mlp.gate.weight": "router",
    "block_sparse_moe.gate.weight": "router",
}
# Where the architecture puts a norm after each sublayer, post_attention_layernorm is that norm
# (in a Llama it is the norm before the feed-forward), and Gemma names the pre-FFN norm.
_POST_NORM_NAMES = {"post_attention_layernorm.weight": "post_attn_norm", "pre_feedforward_layernorm.weight": "ffn_norm"}
_FUSED = {"self_attn.qkv_proj.weight": ("q", "k", "v"), "mlp.gate_up_proj.weight": ("gate", "up")}  # Phi-3
_EXPERTS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_GLOBAL_NAMES = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
GEMMA = ("gemma2", "gemma3_text")  # norms scale by (1 + weight): stored as such at load


def hf_name(key: str) -> str:
    """Canonical name -> the HF tensor name (a Llama's, where an architecture renames it)."""
    if key.startswith("layers."):
        _, idx, suffix = key.split(".", 2)
        stacks = {"mlp.experts.gate_up_proj": "gate_exps", "mlp.experts.down_proj": "down_exps"}
        for names in (_LAYER_NAMES, _POST_NORM_NAMES, stacks):
            hit = next((h for h, c in names.items() if c == suffix), None)
            if hit is not None:
                return f"model.layers.{idx}.{hit}"
        return f"model.layers.{idx}.{suffix}"
    return next(h for h, c in _GLOBAL_NAMES.items() if c == key)


def _rope_params(c: dict, layer_type: str | None = None) -> dict:
    # transformers 5 writes rope_parameters (per layer type for Gemma 3); older configs
    # rope_theta + rope_scaling (which transformers prefers when both are there).
    params = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        params = params.get(layer_type or "full_attention") or {}
    return params


def _rope_scaling(c: dict, path: Path) -> tuple[float, RopeScaling | None]:
    params = _rope_params(c)
    theta = float(params.get("rope_theta", c.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "longrope":  # Phi-3 (factor: the context over the original, unless given)
        max_pos = int(c.get("max_position_embeddings", 2048))
        orig = int(params.get("original_max_position_embeddings") or c.get("original_max_position_embeddings")
                   or max_pos)
        factor = float(params["factor"]) if params.get("factor") is not None else max_pos / orig
        attn = params.get("attention_factor")
        return theta, RopeScaling("longrope", factor, original_max_position=orig,
                                  attention_factor=float(attn) if attn is not None else None,
                                  short_factors=tuple(map(float, params["short_factor"])),
                                  long_factors=tuple(map(float, params["long_factor"])))
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


def _sliding(c: dict, arch: str, file: Path) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window, which layers slide: None for all), as transformers reads them (no window: full attention)."""
    n = int(c["num_hidden_layers"])
    if arch in ("mistral", "mixtral", "phi3"):
        default = 4096 if arch == "mistral" else None  # MistralConfig's default when the key is absent; null: none
        window = c.get("sliding_window", default)
        return (int(window) if window else None), None
    if arch in GEMMA:
        types = c.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        return int(c.get("sliding_window") or 4096), tuple(t == "sliding_attention" for t in types)
    if arch in ("qwen2", "qwen3", "qwen3_moe", "smollm3") and c.get("use_sliding_window") and c.get("sliding_window"):
        # Qwen2Config: layers from max_window_layers on slide (unless layer_types says otherwise).
        first = int(c.get("max_window_layers", 28))
        types = c.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        sliding = tuple(t == "sliding_attention" for t in types)
        if not any(sliding):
            return None, None
        return int(c["sliding_window"]), (None if all(sliding) else sliding)
    return None, None


def _options(c: dict, arch: str, file: Path) -> dict:
    """The architecture's options of ModelConfig (config.py's module doc) from its config.json."""
    o: dict = {}
    if arch in ("qwen3", "qwen3_moe") or arch == "gemma3_text":
        o["qk_norm"] = "head"
    if arch in ("olmo2", "olmoe"):
        o["qk_norm"] = "full"
        if c.get("clip_qkv") is not None:
            raise ModelLoadError(f"{file}: clip_qkv is not supported")
    if arch == "olmo2":
        o |= {"pre_norm": False, "post_norm": True}
    if arch in GEMMA:
        o |= {"post_norm": True, "activation": "gelu_tanh", "embed_scale": float(c["hidden_size"]) ** 0.5,
              "attn_scale": float(c.get("query_pre_attn_scalar") or c.get("head_dim") or 256) ** -0.5,
              "attn_softcap": c.get("attn_logit_softcapping"), "final_softcap": c.get("final_logit_softcapping")}
        act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelLoadError(f"{file}: activation {act!r} is not supported (field hidden_activation)")
    if arch == "gemma3_text":
        local = _rope_params(c, "sliding_attention")
        o["local_rope_theta"] = float(local.get("rope_theta") or c.get("rope_local_base_freq") or 10000.0)
    if arch == "granite":
        o |= {"embed_scale": float(c.get("embedding_multiplier", 1.0)),
              "residual_scale": float(c.get("residual_multiplier", 1.0)),
              "attn_scale": float(c.get("attention_multiplier", 1.0)), "logit_scale": float(c.get("logits_scaling", 1.0))}
    if arch == "smollm3" and c.get("no_rope_layers") is not None:
        o["layer_rope"] = tuple(bool(x) for x in c["no_rope_layers"])
    if arch == "phi3":
        factor = float(_rope_params(c).get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
        head_dim = int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])
        if factor < 1.0:
            o["rotary_dim"] = int(head_dim * factor)
    if arch in ("qwen3_moe", "olmoe", "mixtral"):
        if c.get("mlp_only_layers") or int(c.get("decoder_sparse_step", 1)) != 1:
            raise ModelLoadError(f"{file}: dense layers among the expert layers are not supported "
                                 "(fields mlp_only_layers / decoder_sparse_step)")
        o |= {"n_experts": int(c.get("num_experts") or c.get("num_local_experts")),
              "n_experts_used": int(c["num_experts_per_tok"]),
              "moe_norm_topk": True if arch == "mixtral" else bool(c.get("norm_topk_prob", False))}
    if c.get("mlp_bias"):
        raise ModelLoadError(f"{file}: mlp_bias is not supported")
    if arch not in GEMMA and c.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{file}: activation {c.get('hidden_act')!r} is not supported (field hidden_act)")
    return o


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings", "moe_intermediate_size", "num_experts",
          "num_local_experts", "num_experts_per_tok")


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
        window, sliding = _sliding(c, arch, file)
        options = _options(c, arch, file)
        ffn = c.get("moe_intermediate_size") if options.get("n_experts") and arch == "qwen3_moe" else None
        return ModelConfig(
            arch=arch, vocab_size=int(c["vocab_size"]), hidden=int(c["hidden_size"]),
            intermediate=int(ffn or c["intermediate_size"]), n_layers=int(c["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(c.get("num_key_value_heads") or n_heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // n_heads),
            rope_theta=theta, rms_eps=float(c.get("rms_norm_eps", 1e-6)),
            max_position=int(c.get("max_position_embeddings", 2048)),
            attention_bias=bool(c.get("attention_bias", arch == "qwen2")),
            tie_embeddings=bool(c.get("tie_word_embeddings", arch in GEMMA)),
            rope_scaling=scaling, sliding_window=window, layer_sliding=sliding, **options,
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
    post = cfg.post_norm  # post_attention_layernorm is the norm after attention (module names)
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    for key, t in _canonical(name, post, lambda: f.get_tensor(name)):
                        out[key] = t.float().contiguous()
                        if not torch.isfinite(out[key]).all():  # a NaN weight poisons every row
                            raise ModelLoadError(f"{file}: tensor {name!r} holds NaN or infinite values")
        except ModelLoadError:
            raise
        except Exception as e:  # truncated or corrupt safetensors
            raise ModelLoadError(f"{file}: unreadable safetensors ({type(e).__name__}: {e})") from e
    _stack_experts(cfg, out, path)
    if cfg.arch in GEMMA:  # Gemma's norms scale by (1 + w): fold the 1 in once (as llama.cpp's converter does)
        for key in [k for k in out if k == "norm" or k.endswith("norm")]:
            out[key] = out[key] + 1.0
    if cfg.tie_embeddings:
        out.pop("lm_head", None)
    check_shapes(cfg, out, str(path), {k: hf_name(k) for k in cfg.expected_shapes()})
    return cfg, out


def _canonical(name: str, post_norm: bool, tensor) -> list[tuple[str, torch.Tensor]]:
    """(canonical name, tensor) pairs for one file tensor (fused ones split), [] for tensors
    the model does not use. ``tensor()`` reads it (only when used)."""
    key = _GLOBAL_NAMES.get(name)
    if key is not None:
        return [(key, tensor())]
    if not name.startswith("model.layers."):
        return []
    idx, suffix = name[len("model.layers."):].split(".", 1)
    if not idx.isdigit():
        return []
    p = f"layers.{idx}."
    if post_norm and suffix in _POST_NORM_NAMES:
        return [(p + _POST_NORM_NAMES[suffix], tensor())]
    if suffix in _LAYER_NAMES:
        return [(p + _LAYER_NAMES[suffix], tensor())]
    if suffix in _FUSED:  # Phi-3's qkv_proj / gate_up_proj: split at load, fused again by the model
        return [(p + "fused." + suffix, tensor())]
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # transformers 5: [E, out, in] stacks
        t = tensor()
        if suffix.endswith("down_proj"):
            return [(p + "down_exps", t)]
        g, u = t.chunk(2, dim=1)
        return [(p + "gate_exps", g), (p + "up_exps", u)]
    parts = suffix.split(".")  # one expert's matrix: mlp.experts.E.gate_proj.weight, block_sparse_moe.experts.E.w1.weight
    if len(parts) == 5 and parts[1] == "experts" and parts[2].isdigit() and parts[3] in _EXPERTS:
        return [(p + f"expert.{parts[2]}.{_EXPERTS[parts[3]]}", tensor())]
    return []


def _stack_experts(cfg: ModelConfig, out: dict[str, torch.Tensor], path: Path) -> None:
    """Fused Phi-3 matrices split by the config's sizes; per-expert matrices stacked [E, ...]."""
    for key in [k for k in out if ".fused." in k]:
        t = out.pop(key)
        p = key.split("fused.")[0]
        if key.endswith("qkv_proj.weight"):
            sizes, names = [cfg.q_size, cfg.kv_size, cfg.kv_size], ("q", "k", "v")
        else:
            sizes, names = [cfg.intermediate, cfg.intermediate], ("gate", "up")
        if t.shape[0] != sum(sizes):
            raise ModelLoadError(f"{path}: fused tensor {key} has {t.shape[0]} rows, expected {sum(sizes)}")
        for n, part in zip(names, t.split(sizes)):
            out[p + n] = part.contiguous()
    for i in range(cfg.n_layers if cfg.n_experts else 0):
        p = f"layers.{i}."
        for kind in ("gate", "up", "down"):
            per = [out.pop(f"{p}expert.{e}.{kind}", None) for e in range(cfg.n_experts)]
            if all(t is not None for t in per):
                out[f"{p}{kind}_exps"] = torch.stack(per)
