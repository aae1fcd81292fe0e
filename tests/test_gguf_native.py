"""A GGUF file's own blocks on the native kernels (qmat.py, kernels.c), never requantized.

- Every type the kernels read (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K): the repacked
  matrix dequantizes to exactly ``gguf.quants.dequantize`` of the stored bytes (random bytes
  too: every bit pattern of the quants), its GEMV equals the float64 product of those weights
  with the int8 activations, and a row is the same alone, in a batch, on any thread count and
  in the portable C build.
- Tiny random files of each type (and a Q4_K_M-like mix) load on the default route with every
  matrix in its own blocks; the route's name says the types; rows are batch-invariant and the
  whole step equals op by op; the greedy text equals ``--quant none``'s wherever llama.cpp's
  does; and teacher-forced, ours is at least as close to ``--quant none`` as llama.cpp is.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from gguf.quants import dequantize

from superfluid.bench.fidelity import logits, score
from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime, kernels, native, quantized
from superfluid.runtimes.torch.gguf_weights import load_gguf
from superfluid.runtimes.torch.qmat import NATIVE, QCat, QMat
from superfluid_testing.tiny import TinyModel, quantize_tensor

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="native kernels unavailable")

TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
GEOMETRY = dict(hidden=256, ffn=512, n_heads=4, n_kv_heads=2, n_layers=2, tied=False)
MIX = {"output.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.1.attn_v.weight": Q.Q6_K,
       "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_q.weight": Q.Q5_K, "blk.1.ffn_gate.weight": Q.F16}
FILES = {t.name: (t, {}) for t in TYPES} | {"Q4_K_M": (Q.Q4_K, MIX)}


def random_blocks(qtype: Q, rows: int, K: int, seed: int) -> np.ndarray:
    """Uniformly random bytes, every bit pattern of the quants and sub-block scales, with the
    fp16 super-scales set to finite values (a NaN scale is refused by the loader)."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, K // block, size), dtype=np.uint8)
    for off in {Q.Q6_K: [208], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q4_1: [0, 2], Q.Q5_1: [0, 2]}.get(qtype, [0]):
        raw[..., off:off + 2] = (rng.standard_normal((rows, K // block, 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def reference(x: torch.Tensor, w: np.ndarray) -> torch.Tensor:
    return (kernels.quantize_activations(x).double() @ torch.from_numpy(w).double().T).float()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("blocks", ["quantized", "random"])
def test_blocks_survive_and_multiply_exactly(qtype, blocks):
    N, K = 45, 512  # a partial group of 8 rows
    if blocks == "random":
        raw = random_blocks(qtype, N, K, seed=int(qtype))
    else:
        w = np.random.default_rng(int(qtype)).standard_normal((N, K)).astype(np.float32)
        raw = np.asarray(quantize_tensor(w, qtype)).reshape(N, -1)
    stored = dequantize(raw, qtype).reshape(N, K)
    m = QMat.from_gguf(raw, qtype, K)
    assert m.kind == NATIVE[qtype] and m.source == qtype
    assert np.array_equal(m.dequantize().numpy(), stored)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(6, K, generator=g)
    y = kernels.gemv(x, m)
    ref = reference(x, stored)
    assert (y - ref).abs().max() <= 2e-5 * ref.abs().max()
    assert torch.equal(torch.cat([kernels.gemv(x[i: i + 1], m) for i in range(6)]), y)  # batch-invariant
    acc = torch.randn(6, N, generator=g)
    assert torch.equal(kernels.gemv(x, m, acc.clone(), accumulate=True), acc + y)


def test_parts_of_several_kinds_stack_into_one_product():
    K = 256
    parts = [QMat.from_gguf(random_blocks(t, n, K, i), t, K) for i, (t, n) in
             enumerate([(Q.Q4_K, 20), (Q.Q6_K, 9), (Q.Q8_0, 16)])]
    cat = QCat(parts)
    x = torch.randn(3, K)
    assert torch.equal(kernels.gemv(x, cat), torch.cat([kernels.gemv(x, p) for p in parts], dim=1))
    assert torch.equal(cat.dequantize(), torch.cat([p.dequantize() for p in parts]))
    with pytest.raises(ValueError):
        QCat([parts[0], QMat(torch.randn(8, 64), "q8_0")])  # K differs


def test_every_kind_is_the_same_in_the_portable_avx2_and_wide_builds(tmp_path):
    """The plain C tiles, the 256-bit AVX2 (and VNNI) ones and the 512-bit wide tiles (two
    groups a vector, up to 8 x rows: where the CPU has AVX-512) give the same bits: 19 and 45
    rows (a pair of groups, then a lone or partial one), 1 to 13 x rows, a stack of parts."""
    script = """
import sys, numpy as np, torch
from gguf import GGMLQuantizationType as Q
sys.path.insert(0, sys.argv[2])
from test_gguf_native import TYPES, random_blocks
from superfluid.runtimes.torch import kernels as K
from superfluid.runtimes.torch.qmat import QCat, QMat
g = torch.Generator().manual_seed(3)
xs = [torch.randn(m, 512, generator=g) for m in (1, 5, 8, 13)]
mats = [QMat.from_gguf(random_blocks(t, n, 512, 1), t, 512) for t in TYPES for n in (19, 45)]
mats.append(QCat([QMat.from_gguf(random_blocks(t, n, 512, 2), t, 512) for t, n in ((Q.Q4_K, 20), (Q.Q6_K, 9), (Q.Q8_0, 24))]))
torch.save([K.gemv(x, m) for m in mats for x in xs], sys.argv[1])
"""
    out = []
    for portable, no_vnni, no_512 in (("", "", ""), ("1", "", ""), ("", "1", ""), ("", "", "1")):
        env = dict(os.environ, SUPERFLUID_CACHE=str(tmp_path / "cache"), SUPERFLUID_PORTABLE_KERNELS=portable,
                   SUPERFLUID_KERNELS_NO_VNNI=no_vnni, SUPERFLUID_KERNELS_NO_AVX512=no_512)
        path = tmp_path / f"out{portable}{no_vnni}{no_512}.pt"
        subprocess.run([sys.executable, "-c", script, str(path), os.path.dirname(__file__)], env=env, check=True,
                       timeout=300)
        out.append(torch.load(path))
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ files on the runtime


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("native_types")
    return {name: TinyModel(qtype=t, qtypes=mix, seed=20 + i, **GEOMETRY).write_gguf(d / f"{name}.gguf")
            for i, (name, (t, mix)) in enumerate(FILES.items())}


def t_embed_type(path) -> Q:
    from gguf import GGUFReader

    return Q(next(t.tensor_type for t in GGUFReader(path).tensors if t.name == "token_embd.weight"))


@pytest.mark.parametrize("name", list(FILES))
def test_each_type_loads_as_it_is_on_the_default_route(files, name, monkeypatch):
    assert TorchRuntime(files[name], kv_cache_mb=4).model.embed is not None  # a small table: floats held
    monkeypatch.setattr(quantized, "EMBED_FLOATS_MAX", 0)  # every table as a large one
    rt = TorchRuntime(files[name], kv_cache_mb=4)
    model = rt.model
    assert rt.quant == "gguf" and rt.desc.batch_invariant
    mats = [m for L in model.layers for m in (L.wqkv, L.wo, L.wgu, L.wdown)] + [model.lm_head]
    _, t = load_gguf(files[name])  # the loader's floats: the file's numbers
    floats = [w for i in range(len(model.layers)) for w in (
        torch.cat([t[f"layers.{i}.{n}"] for n in "qkv"]), t[f"layers.{i}.o"],
        torch.cat([t[f"layers.{i}.gate"], t[f"layers.{i}.up"]]), t[f"layers.{i}.down"])] + [t.get("lm_head", t["embed"])]
    for m, w in zip(mats, floats):  # the kernel multiplies by the file's own numbers (requantized: only F16 parts)
        assert torch.equal(m.q.dequantize(), w) or any(p.source is None for p in m.q.parts)
    # every product runs on the kernels: no float copy of a layer matrix is held (4 bytes a weight)
    assert all(m._w is None for m in mats[:-1])
    # nor of the embedding table: its rows are gathered from the file's blocks, the loader's floats
    assert model.embed is None and model.embed_q.source == t_embed_type(files[name])
    ids = torch.tensor([0, 5, 7, 8, 200, 5, 268])
    assert torch.equal(model.embed_rows(ids), t["embed"][ids])
    route = rt.desc.runtime_id.split(":det:gguf:")[1]
    qtype, mix = FILES[name]
    expected = {qtype.name, *(t.name for t in mix.values() if t in NATIVE)} | {"F16>q8_0" for t in mix.values()
                                                                              if t == Q.F16}
    assert set(route.split("+")) == expected, route
    if not mix:  # every matrix from the file's blocks
        assert all(p.source == qtype for m in mats for p in m.q.parts)
    else:  # v in Q6_K under q/k in Q4_K: one fused matrix of two kinds, in the whole step
        assert [p.kind for p in model.layers[0].wqkv.q.parts] == ["q4_k", "q6_k"]
        assert kernels.decoder_refusal(model, rt.kv.k, rt.kv.v) is None


@pytest.mark.parametrize("name", ["Q4_0", "Q5_K", "Q6_K", "Q4_K_M"])
def test_rows_are_batch_and_path_invariant_on_each_type(files, name, monkeypatch):
    """A prompt's rows alone equal the same rows next to another sequence's, in one step or in
    chunks, and the whole step equals op by op (tests/test_e2e_default.py on the default file)."""
    rt = TorchRuntime(files[name], kv_cache_mb=4)
    toks = np.random.default_rng(5).integers(3, 250, 30).tolist()
    alone = logits(rt, toks)
    a, b = rt.seq_create(), rt.seq_create()
    rows = rt.step_rows([Feed(b, toks[::-1][:9], True), Feed(a, toks[:13], True)])[1]
    rows += rt.step_rows([Feed(a, toks[13:], True)])[0]
    assert np.array_equal(np.stack(rows), alone)
    monkeypatch.setattr(native, "WHOLE_STEP", False)
    assert np.array_equal(logits(rt, toks), alone)


def greedy(rt, prompt: list[int], n: int) -> list[int]:
    seq, out, toks = rt.seq_create(), [], list(prompt)
    for _ in range(n):
        row = rt.step([Feed(seq, toks, True)])[0]
        toks = [int(np.argmax(row))]
        out += toks
    rt.seq_free(seq)
    return out


@pytest.mark.parametrize("name", list(FILES))
def test_fidelity_against_llama_cpp_on_each_type(files, name):
    """Against the fp32 dequantization of the same file (``--quant none``), ours and llama.cpp
    (its defaults, fp16 K/V, as llama-server runs): the greedy text equals the reference's on
    as many of 24 prompts as llama.cpp's does, give or take one, and teacher-forced, ours is as
    close.

    A tiny random model's next-token distributions are flat, so either route's rounding flips
    some greedy picks: prompt by prompt the two differ by chance (measured: ours matched
    12-20 of 24, llama.cpp 9-18, per type). The count is a coin-flip proxy: with the 512-bit
    attention (issue 31: another summation order for the scores) Q4_K came out 12 vs 13 while
    its KL was 1.74e-4 vs 3.78e-4 and its top-1 0.968 vs 0.943; hence one prompt of slack,
    and the teacher-forced figures are the measure. On the types with
    32-value blocks both quantize activations to int8 per 32, so their KL ties up to float
    summation order (within 5%); on K-quants llama.cpp's per-256 activations (q8_K) are
    coarser than ours (measured Q4_K: KL 1.8e-4 vs 3.8e-4)."""
    from superfluid.runtimes.llamacpp.runtime import LlamaCppRuntime

    path = files[name]
    ref_rt = TorchRuntime(path, quant="none", dtype="float32", kv_cache_mb=4)
    ours_rt = TorchRuntime(path, kv_cache_mb=4)
    lc = LlamaCppRuntime(path, max_batch=4, n_ctx=512, n_threads=2)
    rng = np.random.default_rng(9)
    ours_same = theirs_same = 0
    for _ in range(24):
        p = rng.integers(3, 250, 12).tolist()
        ref = greedy(ref_rt, p, 12)
        ours_same += greedy(ours_rt, p, 12) == ref
        theirs_same += greedy(lc, p, 12) == ref
    toks = rng.integers(3, 250, 400).tolist()
    ref = logits(ref_rt, toks)
    ours, theirs = score("ours", logits(ours_rt, toks), ref), score("llama.cpp", logits(lc, toks), ref)
    print(f"FIDELITY {name} greedy same {ours_same}/24 vs {theirs_same}/24; ours KL {ours.kl_mean:.2e} top1 "
          f"{ours.top1:.3f} | llama.cpp KL {theirs.kl_mean:.2e} top1 {theirs.top1:.3f}")
    assert ours_same >= theirs_same - 1
    assert ours.kl_mean <= 1.05 * theirs.kl_mean and ours.top1 >= theirs.top1 - 0.02
    if name in ("Q4_K", "Q5_K"):
        assert ours.kl_mean < 0.8 * theirs.kl_mean


def test_the_invariant_route_loads_no_float_copy_of_what_only_blocks_feed(files):
    """floats=False (the default route): a matrix in a kernel's own type is its shape only
    (meta), unless it is stacked with one requantized from floats; a small embedding table
    keeps its floats (it is held as such)."""
    cfg, t = load_gguf(files["Q4_K_M"], blocks={}, floats=False)
    assert t["layers.0.q"].is_meta and t["layers.0.v"].is_meta and t["layers.1.down"].is_meta
    assert not t["layers.1.gate"].is_meta and not t["layers.1.up"].is_meta  # gate is F16: up stacks with it
    assert not t["embed"].is_meta
    _, full = load_gguf(files["Q4_K_M"])
    assert all(not v.is_meta for v in full.values()) and set(full) == set(t)


def test_a_non_finite_block_scale_is_refused_without_floats(files, tmp_path):
    import shutil

    from gguf import GGUFReader

    from superfluid.models import ModelLoadError

    path = tmp_path / "inf.gguf"
    shutil.copy(files["Q8_0"], path)
    r = GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == "blk.1.ffn_down.weight")
    t.data.reshape(-1)[34 * 5: 34 * 5 + 2] = [0x00, 0x7C]  # block 5's fp16 scale: +inf
    r.data.flush()
    del r, t
    with pytest.raises(ModelLoadError, match=r"inf\.gguf.*blk\.1\.ffn_down\.weight.*NaN or infinite"):
        TorchRuntime(path, kv_cache_mb=4)
