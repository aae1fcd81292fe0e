"""A tiny random Mamba or Mamba2: transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM``
weights saved as a Hugging Face folder AND written as a GGUF in llama.cpp's tensor layout
(as llama.cpp's convert_hf_to_gguf.py writes them), so tests compare the two on the same
numbers.

Layout (ggml dims are numpy's reversed): ``ssm_in`` = in_proj [2*d_inner, d_model],
``ssm_conv1d`` = conv1d squeezed to [d_inner, d_conv], ``ssm_x`` = x_proj, ``ssm_dt`` =
dt_proj (weight and bias), ``ssm_a`` = -exp(A_log) [d_inner, d_state], ``ssm_d`` = D,
``ssm_out`` = out_proj; ``output`` = lm_head (untied: a tied head on random weights
echoes the last token forever). The tokenizer is the tiny
byte-level BPE of ``tiny.py``.

Mamba2 (``write_tiny_mamba2``): ``ssm_in`` = in_proj [z | xBC | dt], ``ssm_conv1d`` over xBC,
``ssm_dt.bias`` = dt_bias, ``ssm_a`` / ``ssm_d`` per head [n_heads, 1], ``ssm_norm`` the gated
group norm [n_groups, d_inner / n_groups]; ``ssm.time_step_rank`` = heads, ``ssm.group_count``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from .tiny import save, tiny_vocab, write_tokenizer


def _randomise(model, seed: int) -> None:
    """Weights large enough that greedy picks are clear (the HF init is near-uniform)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", ".D", "dt_bias")):
                continue  # the HF init is already a sensible decay and skip gain
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith("mixer.norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            elif name.endswith("dt_proj.bias"):
                continue
            elif name.endswith("embeddings.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[-1]))


def _hf_model(model_cls, cfg, seed: int, out: Path) -> tuple[dict[str, np.ndarray], Path]:
    """A random transformers model saved under out/hf: (its state dict as float32 numpy, the folder)."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    _randomise(model, seed)
    hf = out / "hf"
    model.save_pretrained(hf)
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}, hf


def _ssm_hparams(w: GGUFWriter, *, d_conv: int, d_inner: int, d_state: int, dt_rank: int) -> None:
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)


def _tokenizer(w: GGUFWriter) -> None:
    """The norm epsilon and the tiny byte-level BPE tokenizer every file here shares."""
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(write_tokenizer(w, "gpt2"))


def _conv(w: GGUFWriter, gp: str, m: str, sd: dict[str, np.ndarray]) -> None:
    """The depthwise conv1d: HF [channels, 1, d_conv] squeezed to [channels, d_conv]."""
    w.add_tensor(gp + "ssm_conv1d.weight", np.ascontiguousarray(sd[m + "conv1d.weight"].squeeze(1)))
    w.add_tensor(gp + "ssm_conv1d.bias", sd[m + "conv1d.bias"])


def _mamba_mixer(w: GGUFWriter, gp: str, m: str, sd: dict[str, np.ndarray], *, norms: bool = False) -> None:
    """One Mamba (v1) mixer under HF prefix ``m``; ``norms``: Jamba's dt / B / C RMS norms."""
    w.add_tensor(gp + "ssm_in.weight", sd[m + "in_proj.weight"])
    _conv(w, gp, m, sd)
    w.add_tensor(gp + "ssm_x.weight", sd[m + "x_proj.weight"])
    if norms:
        w.add_tensor(gp + "ssm_dt_norm.weight", sd[m + "dt_layernorm.weight"])
    w.add_tensor(gp + "ssm_dt.weight", sd[m + "dt_proj.weight"])
    w.add_tensor(gp + "ssm_dt.bias", sd[m + "dt_proj.bias"])
    if norms:
        w.add_tensor(gp + "ssm_b_norm.weight", sd[m + "b_layernorm.weight"])
        w.add_tensor(gp + "ssm_c_norm.weight", sd[m + "c_layernorm.weight"])
    w.add_tensor(gp + "ssm_a", -np.exp(sd[m + "A_log"]).astype(np.float32))
    w.add_tensor(gp + "ssm_d", sd[m + "D"])
    w.add_tensor(gp + "ssm_out.weight", sd[m + "out_proj.weight"])


def _mamba2_mixer(w: GGUFWriter, gp: str, m: str, sd: dict[str, np.ndarray], *, n_heads: int, n_groups: int) -> None:
    """One Mamba2 mixer: per-head A and D as [n_heads, 1], the gated norm as [n_groups, d_inner / n_groups]."""
    w.add_tensor(gp + "ssm_in.weight", sd[m + "in_proj.weight"])
    _conv(w, gp, m, sd)
    w.add_tensor(gp + "ssm_dt.bias", sd[m + "dt_bias"])
    w.add_tensor(gp + "ssm_a", (-np.exp(sd[m + "A_log"])).astype(np.float32).reshape(n_heads, 1))
    w.add_tensor(gp + "ssm_d", sd[m + "D"].reshape(n_heads, 1))
    norm = sd[m + "norm.weight"]
    w.add_tensor(gp + "ssm_norm.weight", norm.reshape(n_groups, norm.shape[0] // n_groups))
    w.add_tensor(gp + "ssm_out.weight", sd[m + "out_proj.weight"])


def _renamed(w: GGUFWriter, gp: str, hp: str, sd: dict[str, np.ndarray], names: tuple[tuple[str, str], ...]) -> None:
    """Weights whose only change is the name: (ours, transformers') pairs."""
    for ours, theirs in names:
        w.add_tensor(gp + ours + ".weight", sd[hp + theirs + ".weight"])


_ATTENTION = (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj"))
_MLP = (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj"))


def _backbone(w: GGUFWriter, sd: dict[str, np.ndarray], n_layers: int, mixer) -> None:
    """Embedding, per layer the input norm and ``mixer(gp, m)``, final norm and head of a
    Mamba / Mamba2 checkpoint (transformers' ``backbone.`` names)."""
    w.add_tensor("token_embd.weight", sd["backbone.embeddings.weight"])
    for i in range(n_layers):
        hp, gp = f"backbone.layers.{i}.", f"blk.{i}."
        w.add_tensor(gp + "attn_norm.weight", sd[hp + "norm.weight"])
        mixer(gp, hp + "mixer.")
    w.add_tensor("output_norm.weight", sd["backbone.norm_f.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])


def write_tiny_mamba(out: str | Path, *, n_layers: int = 2, hidden: int = 64, d_state: int = 16, d_conv: int = 4,
                     seed: int = 0, arch: str = "mamba") -> tuple[Path, Path]:
    """(gguf file, HF folder) of one random Mamba; ``arch`` lets tests write a bad name."""
    from transformers import MambaConfig, MambaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dt_rank = -(-hidden // 16)
    cfg = MambaConfig(vocab_size=len(tiny_vocab()[0]), hidden_size=hidden, state_size=d_state,
                      num_hidden_layers=n_layers, expand=2, conv_kernel=d_conv, time_step_rank=dt_rank,
                      layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    sd, hf = _hf_model(MambaForCausalLM, cfg, seed, out)
    path = out / "mamba.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny-mamba")
    w.add_context_length(1 << 20)  # a recurrent state has no context limit; llama.cpp's converter writes this
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(n_layers)
    _ssm_hparams(w, d_conv=d_conv, d_inner=2 * hidden, d_state=d_state, dt_rank=dt_rank)
    _tokenizer(w)
    _backbone(w, sd, n_layers, lambda gp, m: _mamba_mixer(w, gp, m, sd))
    save(w)
    return path, hf


def write_tiny_mamba2(out: str | Path, *, n_layers: int = 2, hidden: int = 64, d_state: int = 16, d_conv: int = 4,
                      head_dim: int = 16, n_groups: int = 2, seed: int = 0) -> tuple[Path, Path]:
    """(gguf file, HF folder) of one random Mamba2."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    d_inner = 2 * hidden
    n_heads = d_inner // head_dim
    cfg = Mamba2Config(vocab_size=len(tiny_vocab()[0]), hidden_size=hidden, state_size=d_state,
                       num_hidden_layers=n_layers, expand=2, conv_kernel=d_conv, num_heads=n_heads,
                       head_dim=head_dim, n_groups=n_groups, layer_norm_epsilon=1e-5, use_bias=False,
                       use_conv_bias=True, tie_word_embeddings=False, chunk_size=16, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)
    sd, hf = _hf_model(Mamba2ForCausalLM, cfg, seed, out)
    path = out / "mamba2.gguf"
    w = GGUFWriter(str(path), "mamba2")
    w.add_name("tiny-mamba2")
    w.add_context_length(1 << 20)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(n_layers)
    _ssm_hparams(w, d_conv=d_conv, d_inner=d_inner, d_state=d_state, dt_rank=n_heads)
    w.add_ssm_group_count(n_groups)
    _tokenizer(w)
    _backbone(w, sd, n_layers, lambda gp, m: _mamba2_mixer(w, gp, m, sd, n_heads=n_heads, n_groups=n_groups))
    save(w)
    return path, hf


def _jamba_config(*, hidden: int, n_heads: int, n_kv_heads: int, ffn: int, d_state: int, d_conv: int):
    """Two layers: 0 Mamba, 1 attention (period 2, offset 1); one expert, i.e. dense MLPs."""
    from transformers import JambaConfig

    return JambaConfig(vocab_size=len(tiny_vocab()[0]), hidden_size=hidden, intermediate_size=ffn,
                       num_hidden_layers=2, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                       num_experts=1, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                       expert_layer_period=2, expert_layer_offset=1, mamba_d_state=d_state, mamba_d_conv=d_conv,
                       mamba_expand=2, mamba_dt_rank=-(-hidden // 16), mamba_conv_bias=True, mamba_proj_bias=False,
                       rms_norm_eps=1e-5, use_mamba_kernels=False, tie_word_embeddings=False, bos_token_id=1,
                       eos_token_id=2, pad_token_id=0)


def _jamba_layers(w: GGUFWriter, sd: dict[str, np.ndarray]) -> None:
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(2):
        hp, gp = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(gp + "attn_norm.weight", sd[hp + "input_layernorm.weight"])
        if i == 0:
            _mamba_mixer(w, gp, hp + "mamba.", sd, norms=True)
        else:
            _renamed(w, gp, hp + "self_attn.", sd, _ATTENTION)
        w.add_tensor(gp + "ffn_norm.weight", sd[hp + "pre_ff_layernorm.weight"])
        _renamed(w, gp, hp + "feed_forward.", sd, _MLP)
    w.add_tensor("output_norm.weight", sd["model.final_layernorm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])


def write_tiny_jamba(out: str | Path, *, hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 128,
                     d_state: int = 16, d_conv: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """(gguf file, HF folder) of one random Jamba, a hybrid: layer 0 Mamba (with the dt / B / C
    norms), layer 1 attention without RoPE, dense MLPs. llama.cpp tells the kinds apart by the
    per-layer ``attention.head_count_kv`` (0: a Mamba layer)."""
    from transformers import JambaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = _jamba_config(hidden=hidden, n_heads=n_heads, n_kv_heads=n_kv_heads, ffn=ffn, d_state=d_state, d_conv=d_conv)
    sd, hf = _hf_model(JambaForCausalLM, cfg, seed, out)
    path = out / "jamba.gguf"
    w = GGUFWriter(str(path), "jamba")
    w.add_name("tiny-jamba")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(2)
    w.add_head_count(n_heads)
    w.add_head_count_kv([0, n_kv_heads])  # layer 0: Mamba, layer 1: attention
    _ssm_hparams(w, d_conv=d_conv, d_inner=2 * hidden, d_state=d_state, dt_rank=cfg.mamba_dt_rank)
    _tokenizer(w)
    _jamba_layers(w, sd)
    save(w)
    return path, hf
