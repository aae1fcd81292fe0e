"""The architectures of issue 26 as GGUF files written by llama.cpp's own converter
(convert_hf_to_gguf.py from the pinned llama-cpp-python sdist; ``make converter`` puts it in
the venv): the torch runtime reads each with no flags (``--runtime auto`` picks torch), its
reference route equals transformers on the folder the file came from, and its default
(quantized) route agrees with llama.cpp (the llamacpp runtime) on the same file.

Gemma 2's and Phi-3's converters want a sentencepiece tokenizer, which the tiny test one is
not: llama_cpp_convert.py gives them the BPE vocabulary path (their tensors and metadata are
the converter's own). A Gemma 2 file has no query_pre_attn_scalar (llama.cpp takes head_dim,
or hidden / heads at 27B's shape), so its tiny model uses head_dim."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from superfluid.runtimes.auto import pick_runtime
from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime
from test_architectures import reference, run_chunks, tokens, write_family

CONVERTER = Path(sys.executable).parent.parent / "llama.cpp"
GGUF_FAMILIES = ["qwen3", "qwen3_moe", "gemma2", "gemma3_text", "phi3", "phi3_longrope", "smollm3", "olmo2", "olmoe",
                 "granite", "mixtral"]
CONFIG = {"gemma2": dict(query_pre_attn_scalar=16)}  # = head_dim: what a GGUF file can say (module doc)
RUNTIME = {"phi3_longrope": dict(max_seq_len=64)}  # within the original context: the short factors, as transformers


def convert(folder: Path, out: Path) -> Path:
    subprocess.run([sys.executable, str(Path(__file__).parent / "llama_cpp_convert.py"), str(CONVERTER), str(folder),
                    "--outfile", str(out), "--outtype", "f32",
                    "--model-name", "tiny"],  # llama.cpp looks up Phi-3's own special tokens by a "phi3" name
                   check=True, capture_output=True, timeout=300)
    return out


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"llama.cpp's converter is missing from {CONVERTER} (make converter)")
        pytest.skip("llama.cpp's converter is not installed (make converter)")
    from transformers import AutoTokenizer

    from superfluid_testing.tiny import TinyModel

    d = tmp_path_factory.mktemp("arch-gguf")
    TinyModel().write_gguf(d / "t.gguf")
    AutoTokenizer.from_pretrained(d, gguf_file="t.gguf").save_pretrained(d / "tok")
    out = {}
    for f in GGUF_FAMILIES:
        folder = write_family(f, d / f, d / "tok", seed=1, **CONFIG.get(f, {}))
        out[f] = (folder, convert(folder, d / f"{f}.gguf"))
    return out


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_gguf_reference_route_equals_transformers(files, family):
    folder, gguf = files[family]
    assert pick_runtime(gguf)[0] == "torch"
    toks = tokens(40, seed=6)
    ref = reference(folder, toks)
    rt = TorchRuntime(gguf, dtype="float32", quant="none", kv_cache_mb=4, **RUNTIME.get(family, {}))
    for chunks in ([40], [11, 5]):
        assert np.abs(run_chunks(rt, toks, chunks) - ref).max() < 2e-4 * np.abs(ref).max(), chunks


@pytest.mark.parametrize("family", GGUF_FAMILIES)
def test_default_route_agrees_with_llama_cpp(files, family):
    """Teacher-forced top-1 agreement over 3 prompts of 40 tokens, the torch default route
    (no flags) against llama.cpp on the same file; llama.cpp itself held to transformers."""
    from superfluid.runtimes.llamacpp.runtime import LlamaCppRuntime

    folder, gguf = files[family]
    ours = TorchRuntime(gguf, kv_cache_mb=4)  # LongRoPE: 512 positions served, the long factors, as llama.cpp's
    theirs = LlamaCppRuntime(gguf, n_threads=1, kv_f32=True, max_batch=4, n_ctx=512)
    agree = []
    for seed in (1, 2, 3):
        toks = tokens(40, seed)
        a = run_chunks(ours, toks, [40])
        s = theirs.seq_create()
        b = np.stack(theirs.step_rows([Feed(s, toks, True)])[0])
        theirs.seq_free(s)
        if seed == 1 and family not in RUNTIME:  # llama.cpp runs the architecture as transformers does
            # (a fair oracle; under LongRoPE transformers takes the short factors for 40 tokens)
            ref = reference(folder, toks)
            assert np.abs(b - ref).max() < 1e-2 * np.abs(ref).max()
        agree.append(float(np.mean(a.argmax(-1) == b.argmax(-1))))
    print(f"AGREEMENT {family} quant={ours.model.quant} top1={np.mean(agree):.3f}")
    assert np.mean(agree) >= 0.8, agree
