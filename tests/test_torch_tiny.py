"""The torch runtime on tiny random GGUF models: loading, errors, the paged pool,
copy / truncate / export / import, batching and in-runtime sampling. Fast (no real model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from superfluid.abi import LaneParams
from superfluid import sampling
from superfluid.models import ModelLoadError, resolve_model
from superfluid.runtimes.base import Capacity, Feed, OutOfBoundary, RuntimePrimitives, SampleSpec, UnknownSeq
from superfluid.runtimes.torch import TorchRuntime
from superfluid_testing.tiny import TinyModel

PROMPT = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]  # 20 tokens


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    TinyModel().write_gguf(d / "llama.gguf")
    TinyModel(arch="qwen2", qtype=Q.Q8_0, seed=1).write_gguf(d / "qwen2.gguf")
    TinyModel(qtype=Q.Q4_1, tied=False, seed=2).write_gguf(d / "q4.gguf")
    return d


@pytest.fixture(scope="module")
def rt(tiny_dir):
    return TorchRuntime(tiny_dir / "llama.gguf", dtype="float32", quant="none", kv_cache_mb=4)


@pytest.fixture(scope="module")
def det(tiny_dir):
    return TorchRuntime(tiny_dir / "llama.gguf", dtype="float32", quant="none", kv_cache_mb=4, deterministic=True)


def prefill(rt, tokens, chunks=None):
    """A fresh seq holding tokens, fed in the given chunk sizes; returns (seq, last row)."""
    s = rt.seq_create()
    chunks = chunks or [len(tokens)]
    at, row = 0, None
    for n in chunks:
        (row,) = rt.step([Feed(s, tokens[at: at + n], True)])
        at += n
    assert at == len(tokens)
    return s, row


def rows_after(rt, seq, tokens):
    return np.stack(rt.step_rows([Feed(seq, tokens, True)])[0])


# ------------------------------------------------------------------ loading


@pytest.mark.parametrize("name", ["llama.gguf", "qwen2.gguf", "q4.gguf"])
def test_parity_with_transformers(tiny_dir, name):
    from transformers import AutoModelForCausalLM

    rt = TorchRuntime(tiny_dir / name, dtype="float32", quant="none", kv_cache_mb=4)
    assert isinstance(rt, RuntimePrimitives)
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, gguf_file=name, dtype=torch.float32)
    s = rt.seq_create()
    ours = rows_after(rt, s, PROMPT)
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
    assert np.abs(ours - ref).max() < 1e-4


def test_hf_folder_matches_gguf(tiny_dir, tmp_path, rt):
    from transformers import AutoTokenizer

    from superfluid_testing.tiny import write_hf_folder

    write_hf_folder(tiny_dir / "llama.gguf", tmp_path)
    AutoTokenizer.from_pretrained(tiny_dir, gguf_file="llama.gguf").save_pretrained(tmp_path)
    assert resolve_model(tmp_path) == tmp_path
    rh = TorchRuntime(tmp_path, dtype="float32", quant="none", kv_cache_mb=4)
    a = rows_after(rh, rh.seq_create(), PROMPT)
    seq = rt.seq_create()
    b = rows_after(rt, seq, PROMPT)
    rt.seq_free(seq)
    assert np.abs(a - b).max() < 1e-5
    text = "the cat sat on the mat"
    assert rh.tokenizer.encode(text) == rt.tokenizer.encode(text)


def test_bad_files(tiny_dir, tmp_path):
    good = (tiny_dir / "llama.gguf").read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(good[: len(good) // 2])
    with pytest.raises(ModelLoadError, match="trunc.gguf"):
        TorchRuntime(tmp_path / "trunc.gguf", dtype="float32", quant="none")
    (tmp_path / "header.gguf").write_bytes(good[:100])
    with pytest.raises(ModelLoadError, match="header.gguf"):
        TorchRuntime(tmp_path / "header.gguf", dtype="float32", quant="none")
    TinyModel(skip=("blk.1.ffn_up.weight",)).write_gguf(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match=r"missing.gguf.*blk\.1\.ffn_up\.weight"):
        TorchRuntime(tmp_path / "missing.gguf", dtype="float32", quant="none")
    TinyModel(shapes={"blk.0.attn_v.weight": (48, 64)}).write_gguf(tmp_path / "shape.gguf")
    with pytest.raises(ModelLoadError, match=r"shape.gguf.*blk\.0\.attn_v\.weight.*\[48, 64\]"):
        TorchRuntime(tmp_path / "shape.gguf", dtype="float32", quant="none")
    TinyModel(arch="gpt2").write_gguf(tmp_path / "arch.gguf")
    with pytest.raises(ModelLoadError, match=r"arch.gguf: the torch runtime does not run architecture 'gpt2'.*llamacpp"):
        TorchRuntime(tmp_path / "arch.gguf", dtype="float32", quant="none")
    with pytest.raises(ModelLoadError, match="unknown model"):
        resolve_model("no-such-model-anywhere")
    assert issubclass(ModelLoadError, ValueError)


# -------------------------------------------------------------- the KV pool


def test_counters_capacity_and_unknown(tiny_dir):
    rt = TorchRuntime(tiny_dir / "llama.gguf", dtype="float32", quant="none", kv_cache_mb=1)
    page, cb = rt.desc.page, rt.desc.cell_bytes
    assert cb == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 kv heads, head_dim 16, fp32
    total = rt.mem_counters().cells_total
    assert total == (2**20 // (cb * page)) * page
    s = rt.seq_create()
    rt.step([Feed(s, PROMPT, False)])
    m = rt.mem_counters()
    assert m.cells_used == 2 * page and m.allocated_bytes == 2 * page * cb
    assert rt.cells_released([s]) == 2 * page
    with pytest.raises(UnknownSeq):
        rt.seq_len(12345)
    with pytest.raises(UnknownSeq):
        rt.step([Feed(12345, [1], True)])
    with pytest.raises(OutOfBoundary):
        rt.step([Feed(s, [10**6], True)])
    n = -(-total // 4) - page + 1  # four feeds of n tokens want more blocks than are free
    big = [rt.seq_create() for _ in range(4)]
    with pytest.raises(Capacity):
        rt.step([Feed(b, [5] * n, False) for b in big])
    assert all(rt.seq_len(b) == 0 for b in big) and rt.mem_counters().cells_used == 2 * page  # nothing changed
    for b in [s] + big:
        rt.seq_free(b)
    assert rt.mem_counters().cells_used == 0


def test_copy_shares_blocks_and_continues_identically(rt):
    ref_seq, _ = prefill(rt, PROMPT)
    ref = rows_after(rt, ref_seq, [17, 18, 19])
    src, _ = prefill(rt, PROMPT)
    used = rt.mem_counters().cells_used
    dst = rt.seq_create()
    rt.seq_copy(src, dst, len(PROMPT))  # 20 tokens: one whole block shared, the partial one copied
    assert rt.seq_len(dst) == 20
    assert rt.mem_counters().cells_used == used + rt.desc.page
    assert rt.cells_released([dst]) == rt.desc.page  # the shared block stays with src
    assert rt.cells_released([src, dst]) == 3 * rt.desc.page
    np.testing.assert_array_equal(rows_after(rt, dst, [17, 18, 19]), ref)
    np.testing.assert_array_equal(rows_after(rt, src, [17, 18, 19]), ref)  # src untouched by dst's writes
    for s in (ref_seq, src, dst):
        rt.seq_free(s)


def test_truncate_then_refeed(rt):
    full, _ = prefill(rt, PROMPT)
    ref = rows_after(rt, full, [40, 41])
    s, _ = prefill(rt, PROMPT + [100, 101, 102, 103, 104])
    rt.seq_truncate(s, len(PROMPT))
    assert rt.seq_len(s) == len(PROMPT)
    np.testing.assert_allclose(rows_after(rt, s, [40, 41]), ref, atol=1e-5)
    rt.seq_free(s)
    rt.seq_free(full)


def test_truncate_into_shared_block_copies_on_write(rt):
    used = rt.mem_counters().cells_used
    a, _ = prefill(rt, PROMPT[:16] + [7] * 16)  # two full blocks
    b = rt.seq_create()
    rt.seq_copy(a, b, 32)  # both blocks shared
    ref = rows_after(rt, a, [50])
    rt.seq_truncate(a, 32)
    rt.seq_truncate(b, 20)  # b now ends inside a block a still uses
    rows_after(rt, b, [1, 2, 3, 4])  # writes go to a copy of that block
    np.testing.assert_array_equal(rows_after(rt, a, [50]), ref)
    for s in (a, b):
        rt.seq_free(s)
    assert rt.mem_counters().cells_used == used


def test_export_import_round_trip(rt):
    ref_seq, _ = prefill(rt, PROMPT)
    ref = rows_after(rt, ref_seq, [3, 4, 5])
    src, _ = prefill(rt, PROMPT)
    payload = rt.seq_export(src)
    assert isinstance(payload["k"], torch.Tensor) and payload["k"].device.type == "cpu"
    rt.seq_free(src)
    dst = rt.seq_create()
    assert rt.seq_import(dst, payload) == len(PROMPT)
    np.testing.assert_array_equal(rows_after(rt, dst, [3, 4, 5]), ref)
    rt.seq_free(dst)
    rt.seq_free(ref_seq)


# ----------------------------------------------------------------- batching


def mixed_step_vs_alone(rt):
    """Two prefilled seqs decode while two fresh ones prefill chunks of different lengths,
    all in one step; returns (rows of the step, rows each feed gets alone)."""
    a_tokens, b_tokens = PROMPT[:7], PROMPT[3:18]
    feeds_new = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [200, 201, 202, 203, 204]]
    batch_seqs = [prefill(rt, a_tokens)[0], prefill(rt, b_tokens)[0], rt.seq_create(), rt.seq_create()]
    alone_seqs = [prefill(rt, a_tokens)[0], prefill(rt, b_tokens)[0], rt.seq_create(), rt.seq_create()]
    toks = [[21], [22], feeds_new[0], feeds_new[1]]
    batched = rt.step([Feed(s, t, True) for s, t in zip(batch_seqs, toks)])
    alone = [rt.step([Feed(s, t, True)])[0] for s, t in zip(alone_seqs, toks)]
    # then a decode-only step with all four vs alone
    batched += rt.step([Feed(s, [30 + i], True) for i, s in enumerate(batch_seqs)])
    alone += [rt.step([Feed(s, [30 + i], True)])[0] for i, s in enumerate(alone_seqs)]
    for s in batch_seqs + alone_seqs:
        rt.seq_free(s)
    return np.stack(batched), np.stack(alone)


def test_mixed_batch_matches_alone(rt):
    batched, alone = mixed_step_vs_alone(rt)
    assert np.abs(batched - alone).max() < 1e-4


def test_mixed_batch_deterministic_is_exact(det):
    batched, alone = mixed_step_vs_alone(det)
    np.testing.assert_array_equal(batched, alone)


def test_deterministic_chunking_is_exact(det, rt):
    _, whole = prefill(det, PROMPT)
    for chunks in ([5, 15], [1] * 20, [16, 4], [3, 7, 10]):
        _, row = prefill(det, PROMPT, chunks)
        np.testing.assert_array_equal(row, whole)
    _, fast = prefill(rt, PROMPT)
    assert np.abs(fast - whole).max() < 1e-4  # both modes compute the same function


def test_step_rows_matches_step(rt):
    s1, s2 = rt.seq_create(), rt.seq_create()
    rows = rt.step_rows([Feed(s1, PROMPT[:10], False), Feed(s2, PROMPT[:4], False)])
    assert [len(r) for r in rows] == [10, 4]
    _, last = prefill(rt, PROMPT[:10])
    assert np.abs(rows[0][-1] - last).max() < 1e-5
    assert rows[0][0].dtype == np.float32 and rows[0][0].shape == (rt.desc.vocab_size,)
    for s in (s1, s2):
        rt.seq_free(s)


def test_step_sampled_matches_host_sampling(rt):
    specs = [SampleSpec(0.0, 0, 1.0, 0.0, 0), SampleSpec(0.8, 0, 0.95, 0.0, 12345),
             SampleSpec(1.3, 20, 1.0, 0.05, 999), SampleSpec(0.5, 5, 0.5, 0.0, 7)]
    seqs_a = [prefill(rt, PROMPT[i: i + 6])[0] for i in range(4)]
    seqs_b = [prefill(rt, PROMPT[i: i + 6])[0] for i in range(4)]
    toks = rt.step_sampled([Feed(s, [i + 1], True) for i, s in enumerate(seqs_a)], specs)
    rows = rt.step([Feed(s, [i + 1], True) for i, s in enumerate(seqs_b)])
    want = []
    for row, sp in zip(rows, specs):
        if sp.temperature == 0:
            want.append(sampling.argmax(row))
        else:
            p = LaneParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)
            want.append(sampling.sample(row, p, sampling.uniform(sp.rng_position)))
    assert toks == want
    for s in seqs_a + seqs_b:
        rt.seq_free(s)


def test_vocabulary_and_eos(rt):
    v = rt.vocabulary()
    assert len(v.tokens) == rt.desc.vocab_size and v.eos == [2]
    assert rt.is_eos(2) and not rt.is_eos(5)
    assert v.tokens[3 + ord("a") - ord("!")] == b"a"
    assert ("<|im_end|>", 2) in v.specials
    desc = rt.desc
    assert desc.copy_shares_cells and desc.engine_sampling and desc.engine_draws and not desc.exact_only


def test_bf16_mode_close_to_fp32(tiny_dir, rt):
    rb = TorchRuntime(tiny_dir / "llama.gguf", dtype="bfloat16", quant="none", kv_cache_mb=4)
    a, row_a = prefill(rb, PROMPT)
    b, row_b = prefill(rt, PROMPT)
    (dec_a,) = rb.step([Feed(a, [9], True)])  # single-row step: the bf16 GEMV path on plain CPUs
    (dec_b,) = rt.step([Feed(b, [9], True)])
    assert dec_a.dtype == np.float32
    scale = np.abs(row_b).max()
    assert np.abs(row_a - row_b).max() < 0.05 * scale and np.abs(dec_a - dec_b).max() < 0.05 * scale
    assert int(np.argmax(dec_a)) == int(np.argmax(dec_b))
    rt.seq_free(b)


def test_resolve_model(tiny_dir):
    p = resolve_model()
    assert p.suffix == ".gguf" and p.is_file() and "SmolLM2" in p.name
    assert resolve_model(tiny_dir / "llama.gguf") == tiny_dir / "llama.gguf"
    assert resolve_model(str(tiny_dir / "llama.gguf")) == tiny_dir / "llama.gguf"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu(tiny_dir, rt):
    rc = TorchRuntime(tiny_dir / "llama.gguf", dtype="float32", quant="none", device="cuda", kv_cache_mb=4)
    for r in (rc, rt):
        r._out = []
        a, b = prefill(r, PROMPT)[0], prefill(r, PROMPT[:5])[0]
        r._out = np.stack(r.step([Feed(a, [1, 2, 3], True), Feed(b, [4], True)]))
        r.seq_free(a)
        r.seq_free(b)
    assert np.abs(rc._out - rt._out).max() < 1e-3


def test_deterministic_long_prompt_chunking_is_exact(det):
    rng = np.random.default_rng(3)
    prompt = rng.integers(3, 260, 150).tolist()  # spans three key blocks
    s, whole = prefill(det, prompt)
    det.seq_free(s)
    for chunks in ([64, 50, 36], [100, 1, 1, 48], [7] * 21 + [3]):
        s, row = prefill(det, prompt, chunks)
        np.testing.assert_array_equal(row, whole)
        # and alongside an unrelated prefill in the same step
        other = det.seq_create()
        rows = det.step([Feed(other, prompt[:90], True), Feed(s, [5], True)])
        s2, _ = prefill(det, prompt)
        (alone,) = det.step([Feed(s2, [5], True)])
        np.testing.assert_array_equal(rows[1], alone)
        for x in (s, other, s2):
            det.seq_free(x)
