"""The architectures of issue 26 on the torch runtime, against transformers on the same
weights: a tiny random model of each family (transformers' own ``*ForCausalLM`` with a tiny
config, saved as a Hugging Face folder), loaded with no flags but ``--quant none`` and fp32
(the reference route): logits over a prompt fed whole, in chunks and as decodes, and greedy
text, equal transformers'. The default (quantized) route is held to the reference loosely
(its greedy tokens mostly agree); GGUF files and llama.cpp's agreement are in
tests/test_architectures_gguf.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime
from superfluid_testing.tiny import TinyModel
from test_torch_variants import run_chunks, tokens  # noqa: F401 (test_architectures_gguf imports them from here)

VOCAB = 272  # TinyModel's tokenizer has 269 tokens
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0, eos_token_id=0, bos_token_id=1)

# family -> (transformers config class, model class, config overrides); each turns on options
# the others leave off, at sizes where they matter (windows shorter than the prompt, etc.).
FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                                          attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                    dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=16, num_hidden_layers=6,  # 5 local, 1 global
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                          "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                             "rope_theta": 1000000.0}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75)),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM",
                      dict(partial_rotary_factor=0.5, original_max_position_embeddings=64,
                           rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.5, "original_max_position_embeddings": 64,
                                            "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 3.0, 5.0, 8.0]})),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 1, 1, 0])),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict()),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(embedding_multiplier=3.0, residual_multiplier=0.5,
                                                            attention_multiplier=0.2, logits_scaling=2.0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                                moe_intermediate_size=32, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                                      num_key_value_heads=4)),  # llama.cpp's OLMoE has no GQA
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                            intermediate_size=32)),
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("arch-tok")
    TinyModel().write_gguf(d / "t.gguf")
    AutoTokenizer.from_pretrained(d, gguf_file="t.gguf").save_pretrained(d / "tok")
    return d / "tok"


def write_family(family: str, out: Path, tok_dir: Path, seed: int = 0, **overrides) -> Path:
    """A tiny random model of the family as a Hugging Face folder (weights drawn large enough
    that every option moves the logits; norms near their identity); ``overrides``: config fields."""
    import transformers

    cls_cfg, cls_model, extra = FAMILIES[family]
    cfg = getattr(transformers, cls_cfg)(**COMMON | extra | overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_model)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    shutil.copytree(tok_dir, out, dirs_exist_ok=True)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok_dir):
    base = tmp_path_factory.mktemp("arch")
    return {f: write_family(f, base / f, tok_dir) for f in FAMILIES}


def reference(folder: Path, toks: list[int]) -> np.ndarray:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return hf(torch.tensor([toks])).logits[0].numpy()


def hf_greedy(folder: Path, toks: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([toks]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(toks):].tolist()


def greedy(rt, toks: list[int], n: int) -> list[int]:
    s = rt.seq_create()
    row = rt.step_rows([Feed(s, toks, True)])[0][-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(row)))
        row = rt.step_rows([Feed(s, [out[-1]], True)])[0][-1]
    rt.seq_free(s)
    return out


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "phi3_longrope"])
def test_reference_route_equals_transformers(folders, family):
    folder = folders[family]
    toks = tokens(40, seed=3)
    ref = reference(folder, toks)
    rt = TorchRuntime(folder, dtype="float32", quant="none", kv_cache_mb=4)
    assert rt.cfg.arch == family.split("_longrope")[0]
    for chunks in ([40], [7, 13], [3, 1, 9]):  # whole, chunked, then decodes
        ours = run_chunks(rt, toks, chunks)
        err = np.abs(ours - ref).max()
        assert err < 2e-4 * max(1.0, np.abs(ref).max()), (chunks, err)
    assert greedy(rt, toks[:12], 10) == hf_greedy(folder, toks[:12], 10)


def test_longrope_short_and_long_factors(folders):
    """LongRoPE's factors by the context served: within the original 64 positions the short
    ones (transformers' choice for a sequence that short), past it the long ones (transformers'
    choice for a forward longer than 64)."""
    folder = folders["phi3_longrope"]
    toks = tokens(80, seed=4)
    short = TorchRuntime(folder, dtype="float32", quant="none", kv_cache_mb=4, max_seq_len=64)
    ref = reference(folder, toks[:40])
    assert np.abs(run_chunks(short, toks[:40], [40]) - ref).max() < 2e-4 * np.abs(ref).max()
    long = TorchRuntime(folder, dtype="float32", quant="none", kv_cache_mb=4)
    ref = reference(folder, toks)
    assert np.abs(run_chunks(long, toks, [80]) - ref).max() < 2e-4 * np.abs(ref).max()
    assert np.abs(run_chunks(long, toks[:40], [40]) - run_chunks(short, toks[:40], [40])).max() > 1e-2


@pytest.mark.parametrize("family", list(FAMILIES))
def test_default_route_runs_and_mostly_agrees(folders, family):
    """No flags: the quantized default route (native kernels, q4_1 / q8_0) on the same folder."""
    folder = folders[family]
    toks = tokens(24, seed=5)
    ref = reference(folder, toks)
    rt = TorchRuntime(folder, kv_cache_mb=4, **({"max_seq_len": 64} if "longrope" in family else {}))
    ours = run_chunks(rt, toks, [9])
    agree = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    assert agree >= 0.75, agree
    assert np.abs(ours - ref).max() < 0.25 * np.abs(ref).max()
