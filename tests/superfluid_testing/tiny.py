"""Tiny random Llama-family GGUF files, for fast tests of loading, the pool and batching.

``TinyModel(...).write_gguf(path)`` writes a real GGUF (a byte-level BPE tokenizer with a few
merges, or a sentencepiece-style one, chat template, random weights) that both our loader and
transformers' gguf loader can read. Matrices are stored in any type of ``WRITABLE``;
``qtypes`` picks one per tensor, as real files mix types (Q4_K_M keeps some in Q6_K).
``skip`` / ``shapes`` / ``arch`` / ``raw_types`` let tests write broken files on purpose.
``write_hf_folder`` turns such a file into a Hugging Face folder.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, GGUFWriter
from gguf.quants import quantize, quant_shape_to_byte_shape
from safetensors.torch import save_file

from superfluid.runtimes.torch.gguf_weights import load_gguf
from superfluid.runtimes.torch.hf_weights import hf_name
from superfluid.tokenizer import _byte_decoder

TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

# K-quants pack 256 values per block: a row of a K-quant matrix has a multiple of 256 columns.
WRITABLE = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """Specials, the 256 byte symbols, then a few merged words: (tokens, types, merges)."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    symbols = list(_byte_decoder())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "a n", "Ġ s"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = specials + symbols + merged
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    return tokens, types, merges


_SPM_WORDS = ("▁the ▁Hello ▁hello ▁world ▁World ▁this ▁is ▁a ▁cat ▁sat ▁on ▁mat ▁in ▁and ▁of ▁to ing er ed "
              "ello orld ▁café ▁naïve ▁über ▁日本 ▁Straße ▁def ▁return ▁x ▁y ▁don 't ▁I 'm ▁you 'll ▁12 "
              "▁▁ ▁▁▁ ▁▁▁▁ ▁▁▁▁▁▁▁▁ ▁( ): ▁{ ▁} ▁th ▁an")


def tiny_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A sentencepiece (llama) vocabulary laid out like Llama 2's: <unk> <s> </s>, the 256 byte
    tokens <0x00>..<0xFF>, merged pieces best first, then single characters; two control tokens
    ([INST] [/INST], as Mistral has) at the end. Every piece's prefixes are pieces too, so each
    can be reached by merges. (tokens, scores, types)."""
    words = _SPM_WORDS.split()
    pieces = {w[:k] for w in words for k in range(2, len(w) + 1)}
    chars = {c for w in words for c in w} | set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-")
    merged = sorted(pieces - chars, key=lambda p: (len(p), p))
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + merged + sorted(chars)
    scores = [0.0] * 259 + [-float(i) for i in range(len(merged))] + [-1e4 - i for i in range(len(chars))]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(merged) + len(chars))
    return tokens + ["[INST]", "[/INST]"], scores + [0.0, 0.0], types + [3, 3]


def _q4_k(x: np.ndarray, levels: int = 15) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] Q4_K blocks: fp16 d, fp16 dmin, 8 six-bit (scale, min) pairs
    packed in 12 bytes, 256 nibbles; value = d * scale_j * q - dmin * min_j, sub-block j of 32.
    levels=31: Q5_K's [n, 176], the same with a bit plane (qh) before the nibbles."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    d, dmin = (((hi - lo) / levels).max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round((hi - lo) / levels / np.where(d32 > 0, d32, 1)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin32 > 0, dmin32, 1)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round((sub + (dmin32 * mn)[..., None]) / np.where(step > 0, step, 1)), 0, levels).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | (sc[:, 4:] >> 4) << 6, mn[:, :4] | (mn[:, 4:] >> 4) << 6,
                             (sc[:, 4:] & 15) | (mn[:, 4:] & 15) << 4], axis=1)
    # Q5_K's qh: byte l, bit j = bit 4 of value l of sub-block j
    high = [] if levels == 15 else [((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(1, dtype=np.uint8)]
    q = (q & 15).reshape(n, 4, 2, 32)  # byte i of 32-byte group g: low nibble sub-block 2g, high 2g + 1
    qs = (q[:, :, 0] | q[:, :, 1] << 4).reshape(n, 128)
    return np.concatenate([d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales, *high, qs],
                          axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 210] Q6_K blocks: 128 bytes of low nibbles, 64 of high 2-bit pairs,
    16 int8 scales, fp16 d; value = d * scale_j * (q - 32), sub-block j of 16."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), -128, 127).astype(np.int8)
    step = (d32 * sc)[..., None]
    q = (np.clip(np.round(sub / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    low = (q & 15).reshape(n, 2, 2, 64)  # [half, nibble, 64]
    ql = (low[:, :, 0] | low[:, :, 1] << 4).reshape(n, 128)
    high = (q >> 4).reshape(n, 2, 4, 32)  # [half, bit pair, 32]
    qh = (high[:, :, 0] | high[:, :, 1] << 2 | high[:, :, 2] << 4 | high[:, :, 3] << 6).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)


def quantize_tensor(arr: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [rows, cols] -> what GGUFWriter.add_tensor takes with raw_dtype=qtype."""
    if qtype not in WRITABLE:
        raise NotImplementedError(f"tiny GGUF writer cannot quantize to {qtype.name}")
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):  # gguf's quantize does not implement K-quants
        block, size = GGML_QUANT_SIZES[qtype]
        if arr.shape[-1] % block:
            raise ValueError(f"{qtype.name} needs rows of a multiple of {block} values, not {arr.shape[-1]}")
        pack = {Q.Q4_K: _q4_k, Q.Q5_K: lambda b: _q4_k(b, 31), Q.Q6_K: _q6_k}[qtype]
        return pack(arr.astype(np.float32).reshape(-1, block)).reshape(quant_shape_to_byte_shape(arr.shape, qtype))
    return quantize(arr.astype(np.float32), qtype)


def write_tokenizer(w: GGUFWriter, tokenizer: str, pre: str = "default", add_bos: bool | None = None,
                    chat_template: str | None = None) -> int:
    """Tokenizer metadata; returns the vocabulary size. ``pre``: the BPE pre-tokenizer's name;
    ``add_bos``: tokenizer.ggml.add_bos_token (None: the kind's usual, False for BPE as SmolLM2,
    True for sentencepiece as Llama 2); ``chat_template``: None for the tiny one of the kind."""
    if tokenizer == "gpt2":
        tokens, types, merges = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(bool(add_bos))
        w.add_chat_template(chat_template or TINY_TEMPLATE)
    elif tokenizer == "llama":  # as llama.cpp's converter writes Llama 2: no merges, scores instead
        tokens, scores, types = tiny_spm_vocab()
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(add_bos is None or add_bos)
        w.add_add_eos_token(False)
        w.add_chat_template(chat_template or SPM_TEMPLATE)
    else:
        raise ValueError(f"unknown tiny tokenizer {tokenizer!r}")
    return len(tokens)


@dataclass(frozen=True)
class TinyModel:
    """One tiny random Llama-family model: what ``write_gguf`` writes. Variants are
    ``dataclasses.replace`` of a spec, or keyword arguments: ``TinyModel(seed=4, tied=False)``."""

    # geometry
    arch: str = "llama"  # "qwen2" adds the q/k/v biases; any other name writes a file nobody loads
    n_layers: int = 2
    hidden: int = 64
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn: int = 128
    context: int = 512
    tied: bool = True  # no output.weight: the head is the embedding
    # weights
    seed: int = 0
    qtype: Q = Q.F32  # the type of every matrix; vectors stay F32, as llama.cpp keeps norms
    qtypes: Mapping[str, Q] = field(default_factory=dict)  # per-tensor overrides of qtype
    # tokenizer: "gpt2" (byte-level BPE) or "llama" (sentencepiece); pre: the BPE pre-tokenizer's name
    tokenizer: str = "gpt2"
    tokenizer_pre: str = "default"
    add_bos: bool | None = None  # tokenizer.ggml.add_bos_token (None: the tokenizer kind's usual)
    chat_template: str | None = None  # tokenizer.chat_template (None: the tokenizer kind's tiny one)
    # extra fields under the architecture's prefix, e.g. {"attention.sliding_window": 8}
    meta: Mapping[str, str | int | float | bool] = field(default_factory=dict)
    # broken on purpose, for files a loader must reject: tensors left out, shapes replaced,
    # tensors written as random bytes of a ggml type (any type, even ones nobody can quantize to)
    skip: tuple[str, ...] = ()
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    raw_types: Mapping[str, Q] = field(default_factory=dict)

    def write_gguf(self, path: str | Path) -> Path:
        path = Path(path)
        w = GGUFWriter(str(path), self.arch)
        vocab = self._write_metadata(w)
        rng = np.random.default_rng(self.seed)
        for name, shape in self.tensor_shapes(vocab).items():
            if name not in self.skip:
                self._add_tensor(w, name, shape, rng)
        save(w)
        return path

    def _write_metadata(self, w: GGUFWriter) -> int:
        """Hyperparameters and tokenizer; returns the vocabulary size."""
        w.add_name("tiny")
        w.add_block_count(self.n_layers)
        w.add_context_length(self.context)
        w.add_embedding_length(self.hidden)
        w.add_feed_forward_length(self.ffn)
        w.add_head_count(self.n_heads)
        w.add_head_count_kv(self.n_kv_heads)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        vocab = write_tokenizer(w, self.tokenizer, self.tokenizer_pre, self.add_bos, self.chat_template)
        w.add_vocab_size(vocab)
        w.add_rope_dimension_count(self.hidden // self.n_heads)
        for key, value in self.meta.items():  # bool before int: True is an int too
            add = (w.add_bool if isinstance(value, bool) else w.add_uint32 if isinstance(value, int)
                   else w.add_float32 if isinstance(value, float) else w.add_string)
            add(f"{self.arch}.{key}", value)
        return vocab

    def tensor_shapes(self, vocab: int) -> dict[str, tuple[int, ...]]:
        """Tensor name -> numpy shape, in the order they are written (``shapes`` applied)."""
        hidden, ffn, d = self.hidden, self.ffn, self.hidden // self.n_heads
        q, kv = self.n_heads * d, self.n_kv_heads * d  # rows of the query and of each key / value projection
        spec = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,)}
        if not self.tied:
            spec["output.weight"] = (vocab, hidden)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            spec |= {p + "attn_norm.weight": (hidden,), p + "attn_q.weight": (q, hidden),
                     p + "attn_k.weight": (kv, hidden), p + "attn_v.weight": (kv, hidden),
                     p + "attn_output.weight": (hidden, q), p + "ffn_norm.weight": (hidden,),
                     p + "ffn_gate.weight": (ffn, hidden), p + "ffn_up.weight": (ffn, hidden),
                     p + "ffn_down.weight": (hidden, ffn)}
            if self.arch == "qwen2":
                spec |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
        return spec | dict(self.shapes)

    def _add_tensor(self, w: GGUFWriter, name: str, shape: tuple[int, ...], rng: np.random.Generator) -> None:
        """Random values: norms near 1, matrices scaled by fan-in, stored as ``qtype`` / ``qtypes``."""
        if name in self.raw_types:
            raw = self.raw_types[name]
            w.add_tensor(name, rng.integers(0, 256, quant_shape_to_byte_shape(shape, raw), dtype=np.uint8), raw_dtype=raw)
            return
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
            return
        arr = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        if name == "token_embd.weight":
            arr *= 4.0  # embeddings are not scaled by fan-in
        kind = self.qtypes.get(name, self.qtype)
        if kind == Q.F32:
            w.add_tensor(name, arr)
        elif kind == Q.F16:
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, quantize_tensor(arr, kind), raw_dtype=kind)


def save(w: GGUFWriter) -> None:
    """Write out everything added to ``w`` and close the file."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf_folder(gguf: str | Path, out: str | Path, **config) -> Path:
    """A Hugging Face folder (model.safetensors + a llama config.json, ``config`` keys
    overriding) holding the GGUF's weights; the tokenizer is the caller's to add."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg, tensors = load_gguf(Path(gguf))
    save_file({hf_name(k): v for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_eps, "max_position_embeddings": cfg.max_position,
        "tie_word_embeddings": True} | config))
    return out
