"""The native CPU kernels (superfluid/runtimes/torch/kernels.c) against torch references,
and the runtime's quant mode (native.py) on a tiny model. Fast (no real model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime, kernels
from superfluid.runtimes.torch.llama import Llama
from superfluid_testing.tiny import TinyModel

pytestmark = pytest.mark.skipif(kernels.native() is None, reason=f"no native kernels: {kernels.native_error()}")

PROMPT = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]


@pytest.fixture
def threads():
    """Restores torch's thread count (the kernels follow it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def reference_gemv(x: torch.Tensor, m: kernels.QMat) -> torch.Tensor:
    """What the kernel computes, in float64: int8 activations per block (dequantized) times
    the quantized weights."""
    return (kernels.quantize_activations(x).double() @ m.dequantize().double().T).float()


@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
@pytest.mark.parametrize("N,K,M", [(960, 576, 1), (577, 1536, 3), (5, 64, 9), (49152 // 8, 576, 2)])
def test_gemv_matches_reference(kind, N, K, M):
    g = torch.Generator().manual_seed(N + K + M)
    w = torch.randn(N, K, generator=g) * 0.05
    x = torch.randn(M, K, generator=g)
    m = kernels.QMat(w, kind)
    y = kernels.gemv(x, m)
    ref = reference_gemv(x, m)
    assert (y - ref).abs().max() <= 2e-5 * ref.abs().max()
    # and close to the full-precision product (q8_0: ~1%, q4_1 of gaussian weights: ~10%)
    exact = x @ w.T
    assert (y - exact).abs().max() <= (0.03 if kind == "q8_0" else 0.2) * exact.abs().max()
    acc = torch.randn(M, N, generator=g)
    assert torch.allclose(kernels.gemv(x, m, acc.clone(), accumulate=True), acc + y, atol=1e-5)


def test_q4_1_requantizes_q4_1_weights_losslessly():
    # Weights that already are q4_1 values (d q + mn with q spanning 0..15, d and mn fp16 as a
    # GGUF file stores them) come back as they were.
    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (64, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(64, 4, 1, generator=g) * 0.01 + 1e-3).half().float()
    mn = (-torch.rand(64, 4, 1, generator=g) * 0.1).half().float()
    w = (q * d + mn).view(64, 128)
    assert torch.allclose(kernels.QMat(w, "q4_1").dequantize(), w, atol=1e-7)


def test_results_do_not_depend_on_threads_or_batch(threads):
    g = torch.Generator().manual_seed(1)
    m = kernels.QMat(torch.randn(3000, 576, generator=g), "q4_1")
    x = torch.randn(5, 576, generator=g)
    torch.set_num_threads(1)
    one = kernels.gemv(x, m)
    torch.set_num_threads(2)
    two = kernels.gemv(x, m)
    alone = torch.cat([kernels.gemv(x[i: i + 1], m) for i in range(5)])
    assert torch.equal(one, two) and torch.equal(one, alone)


def test_portable_build_agrees(tmp_path):
    """The plain C paths (CPUs without AVX2/FMA) compute the same products, to the bit (the
    same exact block sums, the same FMA chain per output), and the same attention; the VNNI
    dot products (this CPU's native build, where it has them) give exactly the AVX2 ones."""
    import os
    import subprocess
    import sys

    script = """
import torch, sys
from superfluid.runtimes.torch import kernels as K
g = torch.Generator().manual_seed(5)
w, x = torch.randn(70, 576, generator=g), torch.randn(5, 576, generator=g)  # a partial group, a 4 + 1 tile
q, kc = torch.randn(2, 6, 32, generator=g), torch.randn(40, 2, 32, generator=g)
gather = torch.randint(0, 40, (2, 30), generator=g)
out = [K.gemv(x, K.QMat(w, k)) for k in ("q8_0", "q4_1")]
out.append(K.attend_decode(q, kc, kc, gather, torch.tensor([0, 4]), torch.tensor([30, 17])))
torch.save(out, sys.argv[1])
"""
    results = []
    for portable, no_vnni in (("", ""), ("1", ""), ("", "1")):
        env = dict(os.environ, SUPERFLUID_CACHE=str(tmp_path / "cache"), SUPERFLUID_PORTABLE_KERNELS=portable,
                   SUPERFLUID_KERNELS_NO_VNNI=no_vnni)
        path = tmp_path / f"out{portable}{no_vnni}.pt"
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=300)
        results.append(torch.load(path))
    assert len(list((tmp_path / "cache").glob("kernels-*.so"))) == 3
    native, portable, avx2 = results
    for a, b in zip(native[:2], portable[:2]):
        assert torch.equal(a, b)
    assert torch.allclose(native[2], portable[2], rtol=1e-5, atol=1e-5)
    for a, b in zip(native, avx2):  # VNNI (where the CPU has it) and AVX2 dot products: exact integers alike
        assert torch.equal(a, b)


def test_the_256_bit_attention_build_agrees(tmp_path):
    """Issue 31: where the CPU has AVX-512, attention scores 16 keys a vector (each score one
    FMA chain over the head dimension) and adds values four queries at a time; the 256-bit
    build (SUPERFLUID_KERNELS_NO_AVX512) computes the same attention to float rounding, over
    spans that are not multiples of 16, windows, and several head sizes."""
    import os
    import subprocess
    import sys

    script = """
import torch, sys
from superfluid.runtimes.torch import kernels as K
g = torch.Generator().manual_seed(11)
out = []
for H, Hkv, d in ((9, 3, 64), (8, 2, 32), (4, 4, 20), (16, 8, 128)):
    q, kc, vc = torch.randn(70, H, d, generator=g), torch.randn(400, Hkv, d, generator=g), torch.randn(400, Hkv, d, generator=g)
    gather = torch.randperm(400, generator=g)[:300].expand(70, 300).contiguous()
    lens = torch.arange(231, 301)
    first = torch.cat([torch.zeros(60, dtype=torch.int64), torch.full((10,), 37)])
    out.append(K.attend_decode(q, kc, vc, gather, first, lens))
torch.save(out, sys.argv[1])
"""
    results = []
    for no_512 in ("", "1"):
        env = dict(os.environ, SUPERFLUID_CACHE=str(tmp_path / "cache"), SUPERFLUID_KERNELS_NO_AVX512=no_512)
        path = tmp_path / f"out{no_512}.pt"
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=300)
        results.append(torch.load(path))
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_amx_tiles_give_the_wide_tiles_bits(tmp_path):
    """Issue 31: where the CPU has AMX-INT8 (and the OS grants the tile state), steps of >= 16 x
    rows take each block's integer sums from the tile unit and then run the wide tiles' own
    epilogue (q8_0 by default; every kind with SUPERFLUID_KERNELS_AMX_ALL). Every GGUF type the kernels read, a fused matrix whose parts switch the tile
    configuration (Q4_K then Q6_K), x rows in whole tiles and a remainder: the AMX build's
    products equal the build without it (SUPERFLUID_KERNELS_NO_AMX) and each row computed alone,
    to the bit."""
    import os
    import subprocess
    import sys

    script = """
import sys, numpy as np, torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q
from superfluid.runtimes.torch import kernels as K
from superfluid.runtimes.torch.qmat import QCat, QMat
rng = np.random.default_rng(0)
def mat(name, N, Kd):
    qt = Q[name]; block, size = GGML_QUANT_SIZES[qt]
    raw = rng.integers(0, 256, (N, Kd // block, size), dtype=np.uint8)
    for off in {"Q6_K": [208], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q4_1": [0, 2], "Q5_1": [0, 2]}.get(name, [0]):
        raw[..., off:off + 2] = (rng.standard_normal((N, Kd // block, 1)) * .01).astype(np.float16).view(np.uint8)
    return QMat.from_gguf(raw.reshape(N, -1), qt, Kd)
mats = [mat(n, 200, 512) for n in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")]
mats.append(QCat([mat("Q4_K", 72, 512), mat("Q6_K", 48, 512), mat("Q8_0", 40, 512)]))
x = torch.randn(83, 512, generator=torch.Generator().manual_seed(2))
out = {"amx": K.amx(), "y": [[K.gemv(x[:M], m) for M in (16, 37, 64, 83)] for m in mats]}
out["alone"] = [torch.cat([K.gemv(x[i:i + 1], m) for i in range(83)]) for m in mats]
torch.save(out, sys.argv[1])
"""
    results = []
    for no_amx, amx_all in (("", ""), ("", "1"), ("1", "")):  # default (q8_0 on the tiles), every kind, none
        env = dict(os.environ, SUPERFLUID_CACHE=str(tmp_path / "cache"), SUPERFLUID_KERNELS_NO_AMX=no_amx,
                   SUPERFLUID_KERNELS_AMX_ALL=amx_all)
        path = tmp_path / f"out{no_amx}{amx_all}.pt"
        subprocess.run([sys.executable, "-c", script, str(path)], env=env, check=True, timeout=300)
        results.append(torch.load(path))
    default, every, wide = results
    flags = open("/proc/cpuinfo").read()
    has = "amx_int8" in flags and "amx_tile" in flags
    assert default["amx"] == every["amx"] == has and not wide["amx"]  # the tiles ran where the CPU has them
    for run in (default, every):
        for ys, ws, alone in zip(run["y"], wide["y"], run["alone"]):
            for y, w in zip(ys, ws):
                assert torch.equal(y, w) and torch.equal(y, alone[: len(y)])


def test_gemv_rejects_bad_input():
    m = kernels.QMat(torch.randn(8, 64), "q8_0")
    with pytest.raises(ValueError, match="shape"):
        kernels.gemv(torch.randn(1, 32), m)
    with pytest.raises(ValueError, match="float32"):
        kernels.gemv(torch.randn(1, 64, dtype=torch.float64), m)
    with pytest.raises(ValueError, match="float32"):
        kernels.gemv(torch.randn(64, 2).T, m)  # not contiguous
    with pytest.raises(ValueError, match="out"):
        kernels.gemv(torch.randn(1, 64), m, torch.empty(1, 7))
    with pytest.raises(ValueError, match="blocks of 32"):
        kernels.QMat(torch.randn(8, 48), "q8_0")
    with pytest.raises(ValueError, match="unknown quantization"):
        kernels.QMat(torch.randn(8, 64), "q2")


def reference_attend(q, kc, vc, gather, first, lens):
    B, H, d = q.shape
    group = H // kc.shape[1]
    out = torch.empty_like(q)
    for b in range(B):
        cells = gather[b, first[b]: lens[b]]
        k = kc[cells].transpose(0, 1).repeat_interleave(group, 0)  # [H, L, d]
        v = vc[cells].transpose(0, 1).repeat_interleave(group, 0)
        p = torch.softmax(q[b][:, None] @ k.transpose(1, 2) * d ** -0.5, -1)
        out[b] = (p @ v)[:, 0]
    return out


@pytest.mark.parametrize("H,Hkv,d", [(9, 3, 64), (4, 4, 16), (8, 1, 32)])
def test_attend_decode_matches_reference(H, Hkv, d):
    g = torch.Generator().manual_seed(H * d)
    B, S, L = 4, 300, 120
    q, kc, vc = torch.randn(B, H, d, generator=g), torch.randn(S, Hkv, d, generator=g), torch.randn(S, Hkv, d, generator=g)
    gather = torch.randint(0, S, (B, L), generator=g)
    lens = torch.tensor([1, 120, 37, 64])
    first = torch.tensor([0, 0, 20, 63])  # rows 2 and 3: a sliding window
    out = kernels.attend_decode(q, kc, vc, gather, first, lens)
    assert torch.allclose(out, reference_attend(q, kc, vc, gather, first, lens), atol=2e-6)


@pytest.mark.parametrize("H,Hkv,d", [(9, 3, 64), (8, 1, 32), (4, 4, 20), (128, 1, 16), (16, 8, 128)])
def test_tiled_rows_equal_rows_attended_alone(H, Hkv, d):
    """Issue 31: rows over one sequence's keys (a prefill chunk, a draft) walk the keys as a
    tile; each row must come out bit-identical to itself attended alone, whatever shares its
    tile: a chunk of causal rows, a second sequence after it, a sliding window, a short tail."""
    g = torch.Generator().manual_seed(H + d)
    S, L = 900, 700
    q = torch.randn(150, H, d, generator=g)
    kc, vc = torch.randn(S, Hkv, d, generator=g), torch.randn(S, Hkv, d, generator=g)
    seq_a, seq_b = torch.randperm(S, generator=g)[:L], torch.randperm(S, generator=g)[:L]
    lens = torch.cat([torch.arange(560, 660), torch.arange(3, 43), torch.arange(690, 700)])  # 100 + 40 + 10 rows
    gather = torch.cat([seq_a.expand(100, L), seq_b.expand(40, L), seq_a.expand(10, L)]).contiguous()
    first = torch.cat([torch.zeros(140, dtype=torch.int64), torch.full((10,), 600)])  # the last ten: a window
    together = kernels.attend_decode(q, kc, vc, gather, first, lens)
    for b in range(0, 150, 7):
        alone = kernels.attend_decode(q[b:b + 1].contiguous(), kc, vc, gather[b:b + 1].contiguous(), first[b:b + 1],
                                      lens[b:b + 1])
        assert torch.equal(together[b:b + 1], alone), b
    assert torch.allclose(together, reference_attend(q, kc, vc, gather, first, lens), atol=3e-6)


def test_attend_decode_rejects_bad_spans():
    q, kc = torch.randn(1, 4, 16), torch.randn(10, 2, 16)
    gather = torch.zeros(1, 5, dtype=torch.int64)
    z = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="first < lens"):
        kernels.attend_decode(q, kc, kc, gather, z, torch.tensor([6]))
    with pytest.raises(ValueError, match="first < lens"):
        kernels.attend_decode(q, kc, kc, gather, torch.tensor([3]), torch.tensor([3]))
    with pytest.raises(ValueError, match="out of range"):
        kernels.attend_decode(q, kc, kc, gather + 10, z, torch.tensor([5]))


def test_rope_kv_rms_norm_silu_match_torch():
    g = torch.Generator().manual_seed(7)
    T, H, Hkv, d, S = 3, 4, 2, 16, 20
    qkv = torch.randn(T, (H + 2 * Hkv) * d, generator=g)
    pos, slots = torch.tensor([0, 5, 9]), torch.tensor([3, 17, 8])
    ang = torch.arange(12)[:, None] * torch.rand(d // 2, generator=g)[None]
    emb = torch.cat([ang, ang], -1)
    cos, sin = emb.cos().contiguous(), emb.sin().contiguous()
    kc, vc = torch.zeros(S, Hkv, d), torch.zeros(S, Hkv, d)
    q = kernels.rope_kv(qkv, cos, sin, pos, slots, kc, vc, H)
    qk = Llama.rope(qkv[:, : (H + Hkv) * d].view(T, H + Hkv, d), cos[pos][:, None], sin[pos][:, None])
    assert torch.allclose(q, qk[:, :H], atol=1e-6)
    assert torch.allclose(kc[slots], qk[:, H:], atol=1e-6)
    assert torch.equal(vc[slots], qkv[:, (H + Hkv) * d:].view(T, Hkv, d))
    assert kc[[i for i in range(S) if i not in slots.tolist()]].abs().sum() == 0  # nothing else written
    x, w = torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    assert torch.allclose(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5), atol=1e-5)
    gu = torch.randn(4, 256, generator=g)
    assert torch.allclose(kernels.silu_mul(gu), F.silu(gu[:, :128]) * gu[:, 128:], atol=1e-5)


# ---------------------------------------------------------------- runtime quant mode


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("native") / "llama.gguf"
    TinyModel().write_gguf(path)
    return path


def decode_rows(rt, tokens):
    """Rows after each token, feeding the prompt one token per step (the quantized route)."""
    s = rt.seq_create()
    rows = [rt.step([Feed(s, [t], True)])[0] for t in tokens]
    rt.seq_free(s)
    return np.stack(rows)


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_quant_runtime_close_to_fp32(tiny, quant):
    exact = TorchRuntime(tiny, dtype="float32", quant="none", kv_cache_mb=4)
    rt = TorchRuntime(tiny, kv_cache_mb=4, quant=quant, invariant=False)  # the route-dependent mix
    assert rt.desc.runtime_id.endswith(":" + quant)
    ref, got = decode_rows(exact, PROMPT), decode_rows(rt, PROMPT)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err < (0.05 if quant == "q8_0" else 0.25), err
    agree = (got.argmax(-1) == ref.argmax(-1)).mean()
    assert agree >= (0.9 if quant == "q8_0" else 0.6), agree
    # prefill (more than QROWS rows) keeps the full-precision weights: same rows as fp32 mode
    from superfluid.runtimes.torch import native

    long = (PROMPT * 3)[: native.QROWS + 5]
    s = rt.seq_create()
    rows = np.stack(rt.step_rows([Feed(s, long, True)])[0])
    s2 = exact.seq_create()
    rows_exact = np.stack(exact.step_rows([Feed(s2, long, True)])[0])
    assert np.abs(rows - rows_exact).max() < 1e-4


def test_quant_decode_rows_do_not_depend_on_the_batch(tiny):
    # Each prompt prefilled on its own (the same route either way), then one decode step of
    # three lanes together vs each lane alone: bit-identical rows.
    rt = TorchRuntime(tiny, kv_cache_mb=4, quant="q8_0")
    prompts = [PROMPT[:7], PROMPT[3:15], PROMPT[5:9]]

    def prefilled():
        seqs = [rt.seq_create() for _ in prompts]
        for s, p in zip(seqs, prompts):
            rt.step([Feed(s, p, False)])
        return seqs

    together = rt.step([Feed(s, [42], True) for s in prefilled()])
    for s, row in zip(prefilled(), together):
        (alone,) = rt.step([Feed(s, [42], True)])
        assert np.array_equal(alone, row)


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_whole_step_decode_equals_op_by_op(tiny, monkeypatch, quant):
    from superfluid.runtimes.torch import native

    rt = TorchRuntime(tiny, kv_cache_mb=4, quant=quant)
    whole = decode_rows(rt, PROMPT)

    def verify_rows():  # a multi-token step (prefill chunk, draft verification) beside a decode
        a, b = rt.seq_create(), rt.seq_create()
        rt.step([Feed(a, PROMPT[:6], False), Feed(b, PROMPT[:3], False)])
        rows = rt.step_rows([Feed(a, PROMPT[6:11], True), Feed(b, PROMPT[3:4], True)])
        rt.seq_free(a)
        rt.seq_free(b)
        return rows

    multi = verify_rows()
    monkeypatch.setattr(native, "WHOLE_STEP", False)
    assert np.array_equal(decode_rows(rt, PROMPT), whole)
    for x, y in zip(verify_rows(), multi):
        assert len(x) == len(y) and all(np.array_equal(u, v) for u, v in zip(x, y))


def test_quant_greedy_through_step_sampled_matches_step(tiny):
    from superfluid.runtimes.base import SampleSpec

    rt = TorchRuntime(tiny, kv_cache_mb=4, quant="q4_1")
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, PROMPT, False), Feed(b, PROMPT, False)])
    tok_a = tok_b = PROMPT[-1]
    for _ in range(8):
        (tok_a,) = rt.step_sampled([Feed(a, [tok_a], True)], [SampleSpec(0.0, 0, 1.0, 0.0, 0)])
        (row,) = rt.step([Feed(b, [tok_b], True)])
        tok_b = int(np.argmax(row))
        assert tok_a == tok_b


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
def test_deterministic_quant_rows_ignore_chunking_and_batch(tiny, quant):
    """deterministic + quant: every product quantized and every query on the native
    attention, so a row is the same bits however the prompt was chunked (whole, in 7s, one
    token a step) and whatever shares the step (other prefills and decodes)."""
    rt = TorchRuntime(tiny, kv_cache_mb=4, quant=quant, deterministic=True)
    long = (PROMPT * 3)[:50]

    def last_row(chunks, company=()):
        s, at, row = rt.seq_create(), 0, None
        others = [(rt.seq_create(), p) for p in company]
        for o, p in others:
            rt.step([Feed(o, p[:-1], False)])
        for n in chunks:
            feeds = [Feed(s, long[at: at + n], True)] + [Feed(o, p[-1:], True) for o, p in others]
            row = rt.step(feeds)[0]
            at += n
        for q in [s] + [o for o, _ in others]:
            rt.seq_free(q)
        return row

    whole = last_row([50])
    assert np.array_equal(last_row([7] * 7 + [1]), whole)
    assert np.array_equal(last_row([1] * 50), whole)
    assert np.array_equal(last_row([20, 30], company=[PROMPT[:9], PROMPT[2:5]]), whole)
    loose = TorchRuntime(tiny, kv_cache_mb=4, quant=quant, invariant=False)  # for contrast: its prefill takes fp32 GEMMs
    s = loose.seq_create()
    assert not np.array_equal(loose.step([Feed(s, long, True)])[0], whole)


def test_quant_refusals(tiny, monkeypatch):
    with pytest.raises(ValueError, match="unknown quant"):
        TorchRuntime(tiny, kv_cache_mb=4, quant="q3")
    with pytest.raises(ValueError, match="float32"):
        TorchRuntime(tiny, kv_cache_mb=4, quant="q8_0", dtype="float16")
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_error", "no compiler here")
    with pytest.raises(ValueError, match="no compiler here"):
        TorchRuntime(tiny, kv_cache_mb=4, quant="q8_0")


def test_a_failed_allocation_is_an_error_not_garbage():
    """Issue 23: under an address-space limit the scratch malloc fails. Before, attention's
    parts returned without writing (the output was whatever torch.empty held, and the call
    answered 0); now each kernel answers MemoryError. In a child process: the limit is its own."""
    import subprocess
    import sys

    script = """
import resource, torch
from superfluid.runtimes.torch import kernels as K
K.native()
L = 1 << 23                                            # 32 MiB of scores for one part
q, kc = torch.randn(1, 1, 64), torch.randn(4, 1, 64)
gather, first, lens = torch.zeros(1, L, dtype=torch.int64), torch.tensor([0]), torch.tensor([L])
x, m = torch.randn(4096, 1024), K.QMat(torch.randn(64, 1024), "q8_0")   # 4 MiB of int8 activations
vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 20), resource.RLIM_INFINITY))
for name, call in (("attend", lambda: K.attend_decode(q, kc, kc, gather, first, lens, check_cells=False)),
                   ("gemv", lambda: K.gemv(x, m, torch.zeros(4096, 64)))):
    try:
        call()
        print(name, "RETURNED")
    except MemoryError as e:
        print(name, "MemoryError", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attend MemoryError" in out.stdout and "gemv MemoryError" in out.stdout, out.stdout
