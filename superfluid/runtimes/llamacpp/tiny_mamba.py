"""A tiny random Mamba or Mamba2: transformers' ``MambaForCausalLM`` / ``Mamba2ForCausalLM``
weights saved as a Hugging Face folder AND written as a GGUF in llama.cpp's tensor layout
(as llama.cpp's convert_hf_to_gguf.py writes them), so tests compare the two on the same
numbers.

Layout (ggml dims are numpy's reversed): ``ssm_in`` = in_proj [2*d_inner, d_model],
``ssm_conv1d`` = conv1d squeezed to [d_inner, d_conv], ``ssm_x`` = x_proj, ``ssm_dt`` =
dt_proj (weight and bias), ``ssm_a`` = -exp(A_log) [d_inner, d_state], ``ssm_d`` = D,
``ssm_out`` = out_proj; ``output`` = lm_head (untied: a tied head on random weights
echoes the last token forever). The tokenizer is the tiny
byte-level BPE of ``runtimes/torch/tiny.py``.

Mamba2 (``write_tiny_mamba2``): ``ssm_in`` = in_proj [z | xBC | dt], ``ssm_conv1d`` over xBC,
``ssm_dt.bias`` = dt_bias, ``ssm_a`` / ``ssm_d`` per head [n_heads, 1], ``ssm_norm`` the gated
group norm [n_groups, d_inner / n_groups]; ``ssm.time_step_rank`` = heads, ``ssm.group_count``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFWriter

from ..torch.tiny import write_tokenizer, tiny_vocab


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


def write_tiny_mamba(out: str | Path, *, n_layers: int = 2, hidden: int = 64, d_state: int = 16, d_conv: int = 4,
                     seed: int = 0, arch: str = "mamba") -> tuple[Path, Path]:
    """(gguf file, HF folder) of one random Mamba; ``arch`` lets tests write a bad name."""
    import torch
    from transformers import MambaConfig, MambaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(tiny_vocab()[0])
    dt_rank = -(-hidden // 16)
    cfg = MambaConfig(vocab_size=vocab, hidden_size=hidden, state_size=d_state, num_hidden_layers=n_layers,
                      expand=2, conv_kernel=d_conv, time_step_rank=dt_rank, layer_norm_epsilon=1e-5,
                      use_bias=False, use_conv_bias=True, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = MambaForCausalLM(cfg).eval()
    _randomise(model, seed)
    hf = out / "hf"
    model.save_pretrained(hf)

    d_inner = 2 * hidden
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    path = out / "mamba.gguf"
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny-mamba")
    w.add_context_length(1 << 20)  # a recurrent state has no context limit; llama.cpp's converter writes this
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(n_layers)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    write_tokenizer(w, "gpt2")
    w.add_vocab_size(vocab)
    w.add_tensor("token_embd.weight", sd["backbone.embeddings.weight"])
    for i in range(n_layers):
        hp, gp = f"backbone.layers.{i}.", f"blk.{i}."
        m = hp + "mixer."
        w.add_tensor(gp + "attn_norm.weight", sd[hp + "norm.weight"])
        w.add_tensor(gp + "ssm_in.weight", sd[m + "in_proj.weight"])
        w.add_tensor(gp + "ssm_conv1d.weight", np.ascontiguousarray(sd[m + "conv1d.weight"].squeeze(1)))
        w.add_tensor(gp + "ssm_conv1d.bias", sd[m + "conv1d.bias"])
        w.add_tensor(gp + "ssm_x.weight", sd[m + "x_proj.weight"])
        w.add_tensor(gp + "ssm_dt.weight", sd[m + "dt_proj.weight"])
        w.add_tensor(gp + "ssm_dt.bias", sd[m + "dt_proj.bias"])
        w.add_tensor(gp + "ssm_a", -np.exp(sd[m + "A_log"]).astype(np.float32))
        w.add_tensor(gp + "ssm_d", sd[m + "D"])
        w.add_tensor(gp + "ssm_out.weight", sd[m + "out_proj.weight"])
    w.add_tensor("output_norm.weight", sd["backbone.norm_f.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf


def write_tiny_mamba2(out: str | Path, *, n_layers: int = 2, hidden: int = 64, d_state: int = 16, d_conv: int = 4,
                      head_dim: int = 16, n_groups: int = 2, seed: int = 0) -> tuple[Path, Path]:
    """(gguf file, HF folder) of one random Mamba2."""
    import torch
    from transformers import Mamba2Config, Mamba2ForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(tiny_vocab()[0])
    d_inner = 2 * hidden
    n_heads = d_inner // head_dim
    cfg = Mamba2Config(vocab_size=vocab, hidden_size=hidden, state_size=d_state, num_hidden_layers=n_layers,
                       expand=2, conv_kernel=d_conv, num_heads=n_heads, head_dim=head_dim, n_groups=n_groups,
                       layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
                       chunk_size=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(cfg).eval()
    _randomise(model, seed)
    hf = out / "hf"
    model.save_pretrained(hf)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    path = out / "mamba2.gguf"
    w = GGUFWriter(str(path), "mamba2")
    w.add_name("tiny-mamba2")
    w.add_context_length(1 << 20)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(n_layers)
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(n_heads)
    w.add_ssm_group_count(n_groups)
    w.add_layer_norm_rms_eps(1e-5)
    write_tokenizer(w, "gpt2")
    w.add_vocab_size(vocab)
    w.add_tensor("token_embd.weight", sd["backbone.embeddings.weight"])
    for i in range(n_layers):
        hp, gp = f"backbone.layers.{i}.", f"blk.{i}."
        m = hp + "mixer."
        w.add_tensor(gp + "attn_norm.weight", sd[hp + "norm.weight"])
        w.add_tensor(gp + "ssm_in.weight", sd[m + "in_proj.weight"])
        w.add_tensor(gp + "ssm_conv1d.weight", np.ascontiguousarray(sd[m + "conv1d.weight"].squeeze(1)))
        w.add_tensor(gp + "ssm_conv1d.bias", sd[m + "conv1d.bias"])
        w.add_tensor(gp + "ssm_dt.bias", sd[m + "dt_bias"])
        w.add_tensor(gp + "ssm_a", (-np.exp(sd[m + "A_log"])).astype(np.float32).reshape(n_heads, 1))
        w.add_tensor(gp + "ssm_d", sd[m + "D"].reshape(n_heads, 1))
        w.add_tensor(gp + "ssm_norm.weight", sd[m + "norm.weight"].reshape(n_groups, d_inner // n_groups))
        w.add_tensor(gp + "ssm_out.weight", sd[m + "out_proj.weight"])
    w.add_tensor("output_norm.weight", sd["backbone.norm_f.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf


def write_tiny_jamba(out: str | Path, *, hidden: int = 64, n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 128,
                     d_state: int = 16, d_conv: int = 4, seed: int = 0) -> tuple[Path, Path]:
    """(gguf file, HF folder) of one random Jamba, a hybrid: layer 0 Mamba (with the dt / B / C
    norms), layer 1 attention without RoPE, dense MLPs. llama.cpp tells the kinds apart by the
    per-layer ``attention.head_count_kv`` (0: a Mamba layer)."""
    import torch
    from transformers import JambaConfig, JambaForCausalLM

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = len(tiny_vocab()[0])
    dt_rank = -(-hidden // 16)
    cfg = JambaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
                      num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, num_experts=1,
                      num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                      expert_layer_offset=1, mamba_d_state=d_state, mamba_d_conv=d_conv, mamba_expand=2,
                      mamba_dt_rank=dt_rank, mamba_conv_bias=True, mamba_proj_bias=False, rms_norm_eps=1e-5,
                      use_mamba_kernels=False, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      pad_token_id=0)
    torch.manual_seed(seed)
    model = JambaForCausalLM(cfg).eval()
    _randomise(model, seed)
    hf = out / "hf"
    model.save_pretrained(hf)

    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    d_inner = 2 * hidden
    path = out / "jamba.gguf"
    w = GGUFWriter(str(path), "jamba")
    w.add_name("tiny-jamba")
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(2)
    w.add_head_count(n_heads)
    w.add_head_count_kv([0, n_kv_heads])  # layer 0: Mamba, layer 1: attention
    w.add_ssm_conv_kernel(d_conv)
    w.add_ssm_inner_size(d_inner)
    w.add_ssm_state_size(d_state)
    w.add_ssm_time_step_rank(dt_rank)
    w.add_layer_norm_rms_eps(1e-5)
    write_tokenizer(w, "gpt2")
    w.add_vocab_size(vocab)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(2):
        hp, gp = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(gp + "attn_norm.weight", sd[hp + "input_layernorm.weight"])
        if i == 0:
            m = hp + "mamba."
            w.add_tensor(gp + "ssm_in.weight", sd[m + "in_proj.weight"])
            w.add_tensor(gp + "ssm_conv1d.weight", np.ascontiguousarray(sd[m + "conv1d.weight"].squeeze(1)))
            w.add_tensor(gp + "ssm_conv1d.bias", sd[m + "conv1d.bias"])
            w.add_tensor(gp + "ssm_x.weight", sd[m + "x_proj.weight"])
            w.add_tensor(gp + "ssm_dt_norm.weight", sd[m + "dt_layernorm.weight"])
            w.add_tensor(gp + "ssm_dt.weight", sd[m + "dt_proj.weight"])
            w.add_tensor(gp + "ssm_dt.bias", sd[m + "dt_proj.bias"])
            w.add_tensor(gp + "ssm_b_norm.weight", sd[m + "b_layernorm.weight"])
            w.add_tensor(gp + "ssm_c_norm.weight", sd[m + "c_layernorm.weight"])
            w.add_tensor(gp + "ssm_a", -np.exp(sd[m + "A_log"]).astype(np.float32))
            w.add_tensor(gp + "ssm_d", sd[m + "D"])
            w.add_tensor(gp + "ssm_out.weight", sd[m + "out_proj.weight"])
        else:
            a = hp + "self_attn."
            for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                w.add_tensor(gp + ours + ".weight", sd[a + theirs + ".weight"])
        w.add_tensor(gp + "ffn_norm.weight", sd[hp + "pre_ff_layernorm.weight"])
        f = hp + "feed_forward."
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            w.add_tensor(gp + ours + ".weight", sd[f + theirs + ".weight"])
    w.add_tensor("output_norm.weight", sd["model.final_layernorm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf
