"""Tiny random Llama-family GGUF files, for fast tests of loading, the pool and batching.

``write_tiny_gguf`` writes a real GGUF (byte-level BPE tokenizer with a few merges, chat
template, random weights) that both our loader and transformers' gguf loader can read.
``skip`` / ``shapes`` / ``arch`` let tests write broken files on purpose.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from ...tokenizer import _byte_decoder

TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Specials, the 256 byte symbols, then a few merged words: (tokens, types, merges)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = list(_byte_decoder())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "a n", "Ġ s"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + symbols + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


def write_tiny_gguf(path: str | Path, *, arch: str = "llama", n_layers: int = 2, hidden: int = 64,
                    n_heads: int = 4, n_kv_heads: int = 2, ffn: int = 128, context: int = 512,
                    qtype: GGMLQuantizationType = GGMLQuantizationType.F32, tied: bool = True, seed: int = 0,
                    skip: tuple[str, ...] = (), shapes: dict[str, tuple[int, ...]] | None = None) -> Path:
    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    w = GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(n_layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // n_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_TEMPLATE)
    d = hidden // n_heads
    spec = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
    if not tied:
        spec["output.weight"] = (vocab, hidden)
    for i in range(n_layers):
        p = f"blk.{i}."
        spec |= {p + "attn_norm.weight": (hidden,), p + "attn_q.weight": (n_heads * d, hidden),
                 p + "attn_k.weight": (n_kv_heads * d, hidden), p + "attn_v.weight": (n_kv_heads * d, hidden),
                 p + "attn_output.weight": (hidden, n_heads * d), p + "ffn_norm.weight": (hidden,),
                 p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                 p + "ffn_down.weight": (hidden, ffn)}
        if arch == "qwen2":
            spec |= {p + "attn_q.bias": (n_heads * d,), p + "attn_k.bias": (n_kv_heads * d,),
                     p + "attn_v.bias": (n_kv_heads * d,)}
    spec |= shapes or {}
    for name, shape in spec.items():
        if name in skip:
            continue
        if len(shape) == 1:
            arr = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            w.add_tensor(name, arr)
            continue
        arr = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if name == "token_embd.weight":
            arr *= 4.0  # embeddings are not scaled by fan-in
        if qtype == GGMLQuantizationType.F32:
            w.add_tensor(name, arr)
        elif qtype == GGMLQuantizationType.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
