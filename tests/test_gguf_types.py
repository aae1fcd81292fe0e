"""GGUF weight types and the sentencepiece ("llama") GGUF tokenizer, on tiny files.

Weights: a tiny Llama stored in each type the issue names (F16, Q4_0, Q4_1, Q8_0, Q4_K, Q6_K,
and a Q4_K_M-like mix) loads to exactly ``gguf.quants.dequantize`` of the stored bytes (after
undoing llama.cpp's Q/K row permutation), and its logits match transformers, whose GGUF loader
dequantizes with its own torch code. Types we do not read are refused, naming file and tensor.

Tokenizer: our sentencepiece tokenizer against transformers' on the same GGUF, and against
llama.cpp, the reference for GGUF files. The two references differ in one place: llama.cpp (and
sentencepiece) put the "▁" dummy prefix before every piece of text that starts the input or
follows a special token, even one that starts with a space; transformers'
``Metaspace(prepend_scheme="first")`` adds it only at the very start, and only when the text does
not already start with a space. We follow llama.cpp (checked with llama-server's /tokenize).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from superfluid.models import ModelLoadError
from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime
from superfluid.runtimes.torch.gguf_weights import gguf_name, load_gguf, open_gguf
from superfluid_testing.tiny import TinyModel, quantize_tensor, tiny_spm_vocab
from superfluid.tokenizer import Tokenizer

PROMPT = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]
# K-quant blocks hold 256 values, so every matrix row here is a multiple of 256 long.
GEOMETRY = dict(hidden=256, ffn=512, n_heads=4, n_kv_heads=2, n_layers=2, tied=False)
Q4_K_M = {"output.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q6_K,
          "blk.1.attn_q.weight": Q.Q8_0, "blk.1.ffn_gate.weight": Q.F16, "token_embd.weight": Q.Q4_K}
FILES = {  # file -> (type of every matrix, per-tensor overrides)
    "f16.gguf": (Q.F16, {}), "q4_0.gguf": (Q.Q4_0, {}), "q4_1.gguf": (Q.Q4_1, {}), "q8_0.gguf": (Q.Q8_0, {}),
    "q4_k.gguf": (Q.Q4_K, {}), "q6_k.gguf": (Q.Q6_K, {}), "q4_k_m.gguf": (Q.Q4_K, Q4_K_M),
}
LLAMA_CPP_MODELS = Path(os.environ.get("LLAMA_CPP_MODELS", Path(__file__).parent.parent / "build/llama-src/vendor/llama.cpp/models"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("types")
    for i, (name, (qtype, qtypes)) in enumerate(FILES.items()):
        TinyModel(qtype=qtype, qtypes=qtypes, seed=10 + i, **GEOMETRY).write_gguf(d / name)
    TinyModel(tokenizer="llama", seed=3).write_gguf(d / "spm.gguf")
    return d


def logits(rt, tokens):
    return np.stack(rt.step_rows([Feed(rt.seq_create(), tokens, True)])[0])


def hf_logits(folder, name, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].numpy()


# ------------------------------------------------------------------ weights


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K])
def test_k_quant_packing(qtype):
    """tiny.py packs K-quant blocks itself (gguf cannot): dequantizing them gives back the input
    about as closely as gguf's own 4-bit / 5-bit quantizers do."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((16, 512)) / 16).astype(np.float32)
    x[0, :40] = 0.0  # an all-zero sub-block
    x[1, :256] = np.abs(x[1, :256])  # a block with no negative value
    err = np.abs(dequantize(quantize_tensor(x, qtype), qtype).reshape(x.shape) - x).mean()
    baseline = Q.Q4_1 if qtype == Q.Q4_K else Q.Q5_1
    assert err < 1.2 * np.abs(dequantize(quantize_tensor(x, baseline), baseline).reshape(x.shape) - x).mean()
    assert np.all(dequantize(quantize_tensor(x, qtype), qtype).reshape(x.shape)[0, :32] == 0.0)


@pytest.mark.parametrize("name", list(FILES))
def test_tensors_are_the_dequantized_bytes(tiny_dir, name):
    qtype, qtypes = FILES[name]
    path = tiny_dir / name
    cfg, ours = load_gguf(path)
    by_gguf = {t.name: t for t in open_gguf(path).tensors}
    for t in by_gguf.values():
        assert t.tensor_type == (qtypes.get(t.name, qtype) if len(t.shape) == 2 else Q.F32), t.name
    checked = 0
    for key, w in ours.items():
        t = by_gguf[gguf_name(key)]
        stored = dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(n) for n in t.shape])))
        w = w.numpy()
        if key.endswith((".q", ".k")):  # llama.cpp's convert permuted these rows: redo it on ours
            heads = cfg.n_heads if key.endswith(".q") else cfg.n_kv_heads
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        assert w.dtype == np.float32 and np.array_equal(w, stored), key
        checked += 1
    assert checked == len(by_gguf) == 3 + 9 * cfg.n_layers


@pytest.mark.parametrize("name", list(FILES))
def test_parity_with_transformers(tiny_dir, name):
    rt = TorchRuntime(tiny_dir / name, dtype="float32", quant="none", kv_cache_mb=4)
    ours = logits(rt, PROMPT)
    ref = hf_logits(tiny_dir, name, PROMPT)
    assert np.abs(ref).max() > 1.0  # not a degenerate model
    assert np.abs(ours - ref).max() < 1e-4


def test_unsupported_types_are_refused(tmp_path):
    TinyModel(raw_types={"blk.1.ffn_up.weight": Q.IQ2_XXS}, **GEOMETRY).write_gguf(tmp_path / "iq2.gguf")
    with pytest.raises(ModelLoadError, match=r"iq2\.gguf.*'blk\.1\.ffn_up\.weight'.*unsupported type IQ2_XXS"):
        TorchRuntime(tmp_path / "iq2.gguf", dtype="float32", quant="none")
    # a type id no ggml version has: patch the type field of one tensor's info record
    name = b"blk.0.attn_k.weight"
    data = bytearray((tmp_path / "iq2.gguf").read_bytes())
    at = data.index(name) + len(name)  # then: n_dims u32, dims u64 * n_dims, type u32, offset u64
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)
    (tmp_path / "bogus.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"bogus\.gguf.*'blk\.0\.attn_k\.weight' has unknown ggml type 250"):
        TorchRuntime(tmp_path / "bogus.gguf", dtype="float32", quant="none")


# ---------------------------------------------------------------- tokenizer

PLAIN = [
    "Hello world",
    "Hello World!\n\nthe cat sat on the mat\n",
    "tabs\tand\r\nCRLF  then   runs of    spaces",
    "café naïve über Straße 日本語 ёж",
    "emoji 🤗🚀👩‍👩‍👧 and symbols ∑∫√∞",  # not in the vocabulary: byte fallback
    "In 2024 there were 123 cats, 4567 dogs and 3.14159 pies.",
    "def f(x):\n    return {x}  # comment",
    "don't I'm you'll",
    "trailing   ",
    "\n",
    "",
]
LEADING = [" Hello world", "  two spaces", "   three", " ", "    ", " \nnewline", "\tTab"]


@pytest.fixture(scope="module")
def spm(tiny_dir):
    return Tokenizer.from_gguf(tiny_dir / "spm.gguf")


@pytest.fixture(scope="module")
def spm_hf(tiny_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dir, gguf_file="spm.gguf")


@pytest.mark.parametrize("text", PLAIN)
def test_spm_parity(spm, spm_hf, text):
    ids = spm.encode(text)
    assert ids == spm_hf.encode(text, add_special_tokens=False)
    assert spm.decode(ids) == spm_hf.decode(ids, skip_special_tokens=True) == text
    # token bytes carry the dummy prefix, as llama.cpp's pieces do: "▁Hello" is b" Hello"
    assert b"".join(spm.token_bytes(i) for i in ids) == (" " + text if text else "").encode()


@pytest.mark.parametrize("text", LEADING)
def test_spm_leading_space(spm, spm_hf, text):
    """The dummy prefix comes even before a space (llama.cpp, sentencepiece: " Hello" is
    "▁▁Hello"); transformers leaves it out there, so it agrees with us only on one more space."""
    ids = spm.encode(text)
    assert b"".join(spm.token_bytes(i) for i in ids) == (" " + text).encode()
    if text.startswith(" "):
        assert ids == spm_hf.encode(" " + text, add_special_tokens=False)
    else:
        assert ids == spm_hf.encode(text, add_special_tokens=False)
    assert spm.decode(ids) == spm_hf.decode(ids) == text


def test_spm_special_tokens(spm, spm_hf):
    inst, end = spm.backend.token_to_id("[INST]"), spm.backend.token_to_id("[/INST]")
    # llama.cpp: special tokens are matched whole, and each text fragment after one gets the prefix
    assert spm.encode("[INST] hi [/INST] ok</s>") == [inst, *spm.encode(" hi "), end, *spm.encode(" ok"), 2]
    assert spm.encode("<s>hello") == [1, *spm.encode("hello")]
    assert spm.encode("hi", add_special_tokens=True) == spm_hf.encode("hi") == [1, *spm.encode("hi")]
    ids = [1, *spm.encode("Hello world"), 2, 0]
    assert spm.decode(ids) == spm_hf.decode(ids, skip_special_tokens=True)
    assert spm.decode(ids, skip_special_tokens=False) == spm_hf.decode(ids, skip_special_tokens=False)
    assert spm.add_bos and spm.bos_id == 1 and spm.eos_ids == [2] and spm.bos_token == "<s>"
    assert {0, 1, 2, inst, end} == set(spm.special_ids)  # control tokens, and <unk> (llama.cpp, transformers)
    assert spm.encode("a<unk>b") == [*spm.encode("a"), 0, *spm.encode("b")]
    tokens = tiny_spm_vocab()[0]
    assert spm.vocab_size == len(spm_hf) == len(tokens)
    v = spm.vocabulary()
    assert [v.tokens[3 + b] for b in range(256)] == [bytes([b]) for b in range(256)]  # <0x00>..<0xFF>
    assert v.tokens[tokens.index("▁Hello")] == b" Hello" and v.tokens[tokens.index("▁▁▁")] == b"   "
    assert spm.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[INST] hi [/INST]"


def test_spm_model_loads(tiny_dir, spm):
    rt = TorchRuntime(tiny_dir / "spm.gguf", dtype="float32", quant="none", kv_cache_mb=4)
    tokens = rt.tokenizer.encode("the cat sat on the mat", add_special_tokens=True)
    assert tokens == spm.encode("the cat sat on the mat", add_special_tokens=True) and tokens[0] == 1
    assert np.abs(logits(rt, tokens) - hf_logits(tiny_dir, "spm.gguf", tokens)).max() < 1e-4


@pytest.mark.parametrize("vocab", ["ggml-vocab-llama-spm.gguf", "ggml-vocab-phi-3.gguf"])
def test_llama_cpp_reference_vocab(vocab):
    """Real 32k sentencepiece vocabularies (Llama 2, Phi-3) against the token ids llama.cpp's
    tokenizer tests expect. Those files ship in llama.cpp's source tree; skipped without it."""
    path = LLAMA_CPP_MODELS / vocab
    if not (path.is_file() and path.with_name(vocab + ".out").is_file()):
        pytest.skip(f"no llama.cpp vocabulary at {path} (set LLAMA_CPP_MODELS)")
    texts = path.with_name(vocab + ".inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = path.with_name(vocab + ".out").read_text().split("\n")
    tok = Tokenizer.from_gguf(path)
    assert len(texts) > 40
    for text, ids in zip(texts, expected):
        ids = [int(i) for i in ids.split()]
        assert tok.encode(text) == ids, text
        assert b"".join(tok.token_bytes(i) for i in ids) == (" " + text if text else "").encode(), text


# ---------------------------------------------------------------- the default kernel per file

AUTO = {"f16.gguf": "F16>q8_0", "q4_0.gguf": "Q4_0", "q4_1.gguf": "Q4_1", "q8_0.gguf": "Q8_0",
        "q4_k.gguf": "Q4_K", "q6_k.gguf": "Q6_K", "q4_k_m.gguf": "Q4_K+Q6_K+Q8_0+F16>q8_0"}


@pytest.mark.parametrize("name", list(AUTO))
def test_auto_quant_follows_the_files_own_types(tiny_dir, name):
    """quant="auto" (the default) decodes each matrix on the kernel for its own blocks (float
    ones requantized to q8_0), on the batch-invariant route, and the route's name lists the
    types; "none" keeps the reference numerics."""
    rt = TorchRuntime(tiny_dir / name, kv_cache_mb=4)
    assert rt.quant == "gguf" and rt.desc.batch_invariant
    assert rt.desc.runtime_id.endswith(f":det:gguf:{AUTO[name]}"), rt.desc.runtime_id
    ref = TorchRuntime(tiny_dir / name, quant="none", kv_cache_mb=4)
    assert ref.quant is None and not ref.desc.batch_invariant


def test_auto_quant_keeps_full_precision_off_gguf_and_off_cpu(tiny_dir, tmp_path):
    from superfluid.runtimes.torch.quant_choice import resolve_quant

    assert resolve_quant("auto", tiny_dir / "q4_1.gguf", torch.device("cuda")) is None
    assert resolve_quant("auto", tmp_path, torch.device("cpu")) is None  # a Hugging Face folder
    assert resolve_quant("auto", tiny_dir / "q4_1.gguf", torch.device("cpu")) == "gguf"
    assert resolve_quant("q8_0", tiny_dir / "q4_1.gguf", torch.device("cpu")) == "q8_0"
    with pytest.raises(ValueError, match="unknown quant 'q5'"):
        resolve_quant("q5", tiny_dir / "q4_1.gguf", torch.device("cpu"))
