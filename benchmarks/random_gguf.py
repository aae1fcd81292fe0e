"""Random-weight GGUF files at real model shapes, for speed benchmarks (speed does not depend
on the weights' values). The tokenizer and chat template are the real family's, taken from
llama.cpp's vocabulary-only test files and template folder (in the llama-cpp-python sdist
that benchmarks/build_llama_server.sh unpacks and `make converter` extracts); the weights are
written as F16 and then quantized by llama.cpp's own quantizer (llama_model_quantize, through
llama-cpp-python), so a Q4_K_M file has exactly the type mix llama.cpp gives it.

    .venv/bin/python benchmarks/random_gguf.py --shape llama-3.2-1b --type Q4_K_M --out build/rand-1b-q4_k_m.gguf
    .venv/bin/python benchmarks/random_gguf.py --shape qwen3-1.7b --type Q4_K_M --out build/rand-qwen3-1.7b-q4_k_m.gguf
    .venv/bin/python benchmarks/random_gguf.py --shape qwen3-moe-small --type Q4_K_M --out build/rand-qwen3-moe-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter

ROOT = Path(__file__).resolve().parent.parent
VOCABS = ROOT / "build/llama-src/vendor/llama.cpp/models"
TEMPLATES = ROOT / ".venv/llama.cpp/models/templates"
SHAPES = {  # name -> (arch, vocab file, template, hidden, layers, ffn, heads, kv heads, rope base, tied)
    "llama-3.2-1b": ("llama", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                     2048, 16, 8192, 32, 8, 500000.0, True),
    "llama-3.2-3b": ("llama", "ggml-vocab-llama-bpe.gguf", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                     3072, 28, 8192, 24, 8, 500000.0, True),
    # Qwen3-1.7B: head_dim 128 (= hidden / heads), q/k RMSNorm per head, tied embeddings
    "qwen3-1.7b": ("qwen3", "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja",
                   2048, 28, 6144, 16, 8, 1000000.0, True),
}
# shapes with a head size other than hidden / heads, and mixture-of-experts feed-forwards:
# name -> (head_dim, experts, experts used, expert ffn); F above is then only the dense size the key names
EXTRA = {
    # Qwen3-30B-A3B's layer (hidden 2048, 32/4 heads of 128, experts of 768, top 8) with 12
    # layers and 32 experts: ~1.9B weights, ~0.6B active a token; it fits a 24 GiB machine
    "qwen3-moe-small": (128, 32, 8, 768),
}
SHAPES["qwen3-moe-small"] = ("qwen3moe", "ggml-vocab-qwen2.gguf", "Qwen-Qwen3-0.6B.jinja",
                             2048, 12, 6144, 32, 4, 1000000.0, False)
FTYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18, "Q8_0": 7, "Q4_0": 2, "F16": 1}  # llama_ftype


def write_f16(shape: str, out: Path, seed: int = 0) -> Path:
    arch, vocab_file, template, D, L, F, H, Hkv, theta, tied = SHAPES[shape]
    vocab = GGUFReader(VOCABS / vocab_file)
    w = GGUFWriter(str(out), arch)
    for name, f in vocab.fields.items():  # the family's tokenizer, as llama.cpp's converter wrote it
        if name.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub)
    w.add_chat_template((TEMPLATES / template).read_text())
    n_vocab = len(vocab.fields["tokenizer.ggml.tokens"].data)
    d, E, E_used, F_e = EXTRA.get(shape, (D // H, 0, 0, 0))
    w.add_block_count(L)
    w.add_context_length(8192)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(1e-6 if arch.startswith("qwen3") else 1e-5)
    w.add_vocab_size(n_vocab)
    w.add_rope_dimension_count(d)
    if d != D // H:
        w.add_key_length(d)
        w.add_value_length(d)
    if E:
        w.add_expert_count(E)
        w.add_expert_used_count(E_used)
        w.add_expert_feed_forward_length(F_e)
    w.add_file_type(1)
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols), dtype=np.float32) * (scale / np.sqrt(cols))).astype(np.float16)

    w.add_tensor("token_embd.weight", mat(n_vocab, D, 4.0))
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    if not tied:
        w.add_tensor("output.weight", mat(n_vocab, D))
    for i in range(L):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(D, np.float32))
        w.add_tensor(p + "attn_q.weight", mat(H * d, D))
        w.add_tensor(p + "attn_k.weight", mat(Hkv * d, D))
        w.add_tensor(p + "attn_v.weight", mat(Hkv * d, D))
        w.add_tensor(p + "attn_output.weight", mat(D, H * d))
        if arch in ("qwen3", "qwen3moe"):  # per-head q/k norms (F32, as the converter writes norms)
            w.add_tensor(p + "attn_q_norm.weight", np.ones(d, np.float32))
            w.add_tensor(p + "attn_k_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(D, np.float32))
        if E:  # a router and E experts, stacked [E, rows, cols]
            w.add_tensor(p + "ffn_gate_inp.weight", mat(E, D))
            w.add_tensor(p + "ffn_gate_exps.weight", np.stack([mat(F_e, D) for _ in range(E)]))
            w.add_tensor(p + "ffn_up_exps.weight", np.stack([mat(F_e, D) for _ in range(E)]))
            w.add_tensor(p + "ffn_down_exps.weight", np.stack([mat(D, F_e) for _ in range(E)]))
            continue
        w.add_tensor(p + "ffn_gate.weight", mat(F, D))
        w.add_tensor(p + "ffn_up.weight", mat(F, D))
        w.add_tensor(p + "ffn_down.weight", mat(D, F))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def quantize(src: Path, out: Path, kind: str, threads: int = 2) -> Path:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc:
        raise RuntimeError(f"llama_model_quantize failed ({rc})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    ap.add_argument("--type", choices=list(FTYPES), default="Q4_K_M")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    f16 = args.out.with_suffix(".f16.gguf")
    if not f16.exists():
        write_f16(args.shape, f16, args.seed)
    if args.type == "F16":
        f16.rename(args.out)
    else:
        quantize(f16, args.out, args.type)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
