"""Llama-family variants on tiny random models, against transformers on the same weights:
Mistral sliding-window attention (fast and batch-invariant kernels, chunked prefill and
decodes) and YaRN RoPE scaling (frequencies, attention factor, HF and GGUF metadata)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from superfluid.models import ModelLoadError
from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime
from superfluid.runtimes.torch.config import ModelConfig
from superfluid.runtimes.torch.hf_weights import _rope_scaling, read_config
from superfluid_testing.tiny import TinyModel, write_hf_folder

WINDOW = 8
CONTEXT = 512  # TinyModel's context
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0}
YARN_GGUF = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "rope.scaling.original_context_length": 32,
             "rope.scaling.yarn_beta_fast": 16.0}


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 260, n).tolist()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny llama GGUF (weights and tokenizer shared by every folder built below)."""
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("variants")
    TinyModel().write_gguf(d / "llama.gguf")
    AutoTokenizer.from_pretrained(d, gguf_file="llama.gguf").save_pretrained(d / "tok")
    return d


def hf_folder(base: Path, name: str, **config) -> Path:
    """An HF folder (safetensors + config.json + tokenizer) holding base's weights."""
    out = base / name
    if out.exists():
        return out
    shutil.copytree(base / "tok", out)
    return write_hf_folder(base / "llama.gguf", out, **config)


def reference(folder, toks: list[int]) -> np.ndarray:
    """transformers' logits [len(toks), V] for one full forward over toks."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.inference_mode():
        return hf(torch.tensor([toks])).logits[0].numpy()


def run_chunks(rt, toks: list[int], chunks: list[int]) -> np.ndarray:
    """Every row's logits, feeding toks in the given chunks then one token a step."""
    s = rt.seq_create()
    rows, at = [], 0
    for n in chunks + [1] * (len(toks) - sum(chunks)):
        rows += rt.step_rows([Feed(s, toks[at: at + n], True)])[0]
        at += n
    rt.seq_free(s)
    return np.stack(rows)


# ------------------------------------------------------------ sliding window


@pytest.fixture(scope="module")
def mistral(base):
    return hf_folder(base, "mistral", model_type="mistral", sliding_window=WINDOW)


@pytest.mark.parametrize("deterministic", [False, True])
def test_mistral_sliding_window_matches_transformers(mistral, base, deterministic):
    toks = tokens(36, seed=5)
    ref = reference(mistral, toks)
    full = reference(hf_folder(base, "llama"), toks)
    assert np.abs(ref[WINDOW:] - full[WINDOW:]).max() > 1e-2  # the window matters past its length
    np.testing.assert_allclose(ref[:WINDOW], full[:WINDOW], atol=1e-5)  # ... and not before
    rt = TorchRuntime(mistral, dtype="float32", quant="none", kv_cache_mb=4, deterministic=deterministic)
    assert rt.cfg.sliding_window == WINDOW and rt.desc.max_seq_len == min(8192, CONTEXT)  # no cap at the window
    for chunks in ([36], [5, 13], [3, 3, 9, 1, 4], [20]):  # whole, chunked, then decodes
        ours = run_chunks(rt, toks, chunks)
        assert np.abs(ours - ref).max() < 1e-4, chunks


def test_mistral_mixed_batch_matches_transformers(mistral):
    """Decodes and prefill chunks of several sequences in one step (both kernels)."""
    a, b, c = tokens(30, 1), tokens(25, 2), tokens(12, 3)
    refs = [reference(mistral, t) for t in (a, b, c)]
    for det in (False, True):
        rt = TorchRuntime(mistral, dtype="float32", quant="none", kv_cache_mb=4, deterministic=det)
        sa, sb, sc = rt.seq_create(), rt.seq_create(), rt.seq_create()
        rt.step([Feed(sa, a[:29], False), Feed(sb, b[:10], False)])
        rows = rt.step_rows([Feed(sa, a[29:], True), Feed(sb, b[10:], True), Feed(sc, c, True)])
        assert np.abs(np.stack(rows[0]) - refs[0][29:]).max() < 1e-4
        assert np.abs(np.stack(rows[1]) - refs[1][10:]).max() < 1e-4
        assert np.abs(np.stack(rows[2]) - refs[2]).max() < 1e-4
        for s in (sa, sb, sc):
            rt.seq_free(s)


def test_mistral_window_deterministic_long_prompt(mistral):
    """Keys blocks wholly before every query's window (150 > 2 KEY_BLOCKs): still exact and
    chunking-invariant in the batch-invariant kernel, and equal to transformers."""
    toks = tokens(150, seed=9)
    ref = reference(mistral, toks)
    det = TorchRuntime(mistral, dtype="float32", quant="none", kv_cache_mb=4, deterministic=True)
    whole = run_chunks(det, toks, [150])
    assert np.abs(whole - ref).max() < 1e-4
    for chunks in ([64, 50, 36], [100, 1, 1, 40], [7] * 20):
        np.testing.assert_array_equal(run_chunks(det, toks, chunks)[-1], whole[-1])
    fast = TorchRuntime(mistral, dtype="float32", quant="none", kv_cache_mb=4)
    assert np.abs(run_chunks(fast, toks, [70, 50]) - ref).max() < 1e-4


def test_gguf_sliding_window_metadata(base, mistral, tmp_path):
    path = TinyModel(meta={"attention.sliding_window": WINDOW}).write_gguf(tmp_path / "swa.gguf")
    rg = TorchRuntime(path, dtype="float32", quant="none", kv_cache_mb=4)
    assert rg.cfg.sliding_window == WINDOW
    toks = tokens(30, seed=4)
    assert np.abs(run_chunks(rg, toks, [11]) - reference(mistral, toks)).max() < 1e-4


def write_config(tmp_path, **c) -> ModelConfig:
    base = {"model_type": "mistral", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4}
    (tmp_path / "config.json").write_text(json.dumps(base | c))
    return read_config(tmp_path)


def test_hf_sliding_window_fields(tmp_path):
    assert write_config(tmp_path).sliding_window == 4096  # MistralConfig's default
    assert write_config(tmp_path, sliding_window=None).sliding_window is None
    assert write_config(tmp_path, sliding_window=100).sliding_window == 100
    assert write_config(tmp_path, model_type="llama", sliding_window=100).sliding_window is None
    q = {"model_type": "qwen2", "sliding_window": 100}
    assert write_config(tmp_path, **q).sliding_window is None  # use_sliding_window defaults to false
    assert write_config(tmp_path, **q, use_sliding_window=True).sliding_window is None  # max_window_layers 28 > 2
    assert write_config(tmp_path, **q, use_sliding_window=True, max_window_layers=0).sliding_window == 100
    some = write_config(tmp_path, **q, use_sliding_window=True, max_window_layers=1)  # layer 1 slides, 0 does not
    assert some.layer_sliding == (False, True) and [some.window(i) for i in (0, 1)] == [None, 100]


# ---------------------------------------------------------------------- YaRN

ROPE_CASES = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1.5},
    {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 100, "truncate": False},
    {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 2048},  # factor <= 1: no mscale
]


@pytest.mark.parametrize("head_dim, theta", [(16, 10000.0), (128, 500000.0), (64, 1e6)])
@pytest.mark.parametrize("scaling", ROPE_CASES)
def test_rope_tables_match_transformers(scaling, head_dim, theta):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = {"hidden_size": 4 * head_dim, "num_attention_heads": 4, "head_dim": head_dim, "max_position_embeddings": 1024,
         "rope_theta": theta}
    if scaling is not None:
        c["rope_scaling"] = dict(scaling)
    hf = LlamaRotaryEmbedding(LlamaConfig(**json.loads(json.dumps(c))))
    got_theta, rs = _rope_scaling(c, "config.json")
    cfg = ModelConfig("llama", 300, 4 * head_dim, 64, 1, 4, 4, head_dim, got_theta, 1e-6, 1024, rope_scaling=rs)
    inv, factor = cfg.rope()
    assert torch.equal(inv, hf.inv_freq), (inv - hf.inv_freq).abs().max()
    assert factor == pytest.approx(hf.attention_scaling, rel=1e-12)
    if scaling and scaling.get("factor") and (scaling.get("rope_type") or scaling.get("type")) == "yarn":
        assert not torch.equal(inv, ModelConfig("llama", 300, 4 * head_dim, 64, 1, 4, 4, head_dim, theta, 1e-6,
                                                1024).rope()[0])


def test_llama_yarn_matches_transformers(base):
    folder = hf_folder(base, "yarn", rope_scaling=YARN)
    toks = tokens(120, seed=7)  # well past original_max_position_embeddings (32)
    ref = reference(folder, toks)
    assert np.abs(ref - reference(hf_folder(base, "llama"), toks)).max() > 1e-2  # the scaling matters
    rt = TorchRuntime(folder, dtype="float32", quant="none", kv_cache_mb=4)
    _, attn = rt.cfg.rope()
    assert attn == pytest.approx(0.1 * np.log(4.0) + 1)
    assert rt.model.cos[0, 0].item() == pytest.approx(attn)  # cos(0) * attention factor
    assert np.abs(run_chunks(rt, toks, [50, 60]) - ref).max() < 1e-4
    det = TorchRuntime(folder, dtype="float32", quant="none", kv_cache_mb=4, deterministic=True)
    assert np.abs(run_chunks(det, toks, [117]) - ref).max() < 1e-4


def test_gguf_yarn_metadata(base, tmp_path):
    folder = hf_folder(base, "yarn", rope_scaling=YARN)
    path = TinyModel(meta=YARN_GGUF).write_gguf(tmp_path / "yarn.gguf")
    rg, rh = TorchRuntime(path, dtype="float32", quant="none", kv_cache_mb=4), TorchRuntime(folder, dtype="float32", quant="none", kv_cache_mb=4)
    assert rg.cfg.rope_scaling == rh.cfg.rope_scaling
    inv_g, a_g = rg.cfg.rope()
    inv_h, a_h = rh.cfg.rope()
    assert torch.equal(inv_g, inv_h) and a_g == a_h
    toks = tokens(80, seed=8)
    assert np.abs(run_chunks(rg, toks, [80]) - run_chunks(rh, toks, [80])).max() < 1e-5
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'longrope'"):
        TorchRuntime(TinyModel(meta={"rope.scaling.type": "longrope"}).write_gguf(tmp_path / "bad.gguf"), dtype="float32")
