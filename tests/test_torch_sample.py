"""The torch in-runtime sampler is the host sampler (superfluid/sampling.py), token for
token: thousands of random rows (peaked, tied, flat, masked) over every filter, mixed
greedy and sampled lanes, and TorchRuntime's step_sampled on a tiny model against host
sampling of step() rows. Fast (CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from superfluid.abi import LaneParams
from superfluid import sampling
from superfluid.runtimes.base import Feed, SampleSpec
from superfluid.runtimes.torch import TorchRuntime
from superfluid.runtimes.torch.sample import _exp, _weights, sample_lanes
from superfluid_testing.tiny import TinyModel

V = 1000


def host(row: np.ndarray, spec: SampleSpec) -> int:
    if spec.temperature <= 0.0:
        return sampling.argmax(row)
    p = LaneParams(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p)
    return sampling.sample(row, p, sampling.uniform(spec.rng_position))


def random_row(rng: np.random.Generator) -> np.ndarray:
    kind = rng.integers(0, 6)
    if kind == 0:  # peaked: one or a few tokens dominate
        row = rng.normal(0, 1, V)
        row[rng.integers(0, V, rng.integers(1, 4))] += rng.uniform(5, 30)
    elif kind == 1:  # ties everywhere: a few logit levels
        row = rng.integers(-3, 4, V).astype(np.float64)
    elif kind == 2:  # tied best tokens over a normal tail
        row = rng.normal(0, 2, V)
        row[rng.choice(V, rng.integers(2, 6), replace=False)] = row.max() + 1.0
    elif kind == 3:  # flat: the nucleus holds most of the row
        row = rng.normal(0, 0.05, V)
    elif kind == 4:  # masked ids (a grammar's -inf) over a wide normal
        row = rng.normal(0, 4, V)
        row[rng.random(V) < rng.uniform(0.1, 0.99)] = -np.inf
        row[rng.integers(0, V)] = 0.0
    else:
        row = rng.normal(0, rng.uniform(0.5, 8), V)
    return row.astype(np.float32)


def random_spec(rng: np.random.Generator) -> SampleSpec:
    if rng.random() < 0.1:
        return SampleSpec(0.0, 0, 1.0, 0.0, int(rng.integers(0, 1 << 62)))
    return SampleSpec(temperature=float(rng.uniform(0.2, 2.0)),
                      top_k=int(rng.choice([0, 0, 1, 5, 50, V + 10])),
                      top_p=float(rng.choice([1.0, rng.uniform(0.1, 1.0)])),
                      min_p=float(rng.choice([0.0, rng.uniform(0.0, 0.3)])),
                      rng_position=int(rng.integers(0, 1 << 63)))


def test_torch_sampler_matches_host_sampler_on_random_rows():
    rng = np.random.default_rng(20240611)
    n = 0
    for _ in range(60):
        b = int(rng.integers(1, 65))
        rows = np.stack([random_row(rng) for _ in range(b)])
        specs = [random_spec(rng) for _ in range(b)]
        want = [host(row, spec) for row, spec in zip(rows, specs)]
        assert sample_lanes(torch.from_numpy(rows), specs, batched=True) == want  # the batch, as off a CPU
        assert sample_lanes(torch.from_numpy(rows), specs) == want
        n += b
    assert n > 1500


def test_the_same_primitives_give_the_same_numbers():
    """The one float operation the two samplers share, exp in float32, bit for bit (torch.exp
    itself is not numpy's on every CPU, so the torch sampler takes numpy's there); and the
    integer weights of a [S, V] batch are each row's own."""
    x = np.random.default_rng(3).normal(0, 30, 1 << 20).clip(-100, 0).astype(np.float32)
    assert np.array_equal(np.exp(x), _exp(torch.from_numpy(x)).numpy())
    t = torch.from_numpy(x.reshape(1024, 1024)).t()  # not contiguous
    assert np.array_equal(np.exp(t.numpy()), _exp(t).numpy())
    rows = np.random.default_rng(4).normal(0, 6, (7, 1001)).astype(np.float32)
    specs = [SampleSpec(float(t), 0, 1.0, 0.0, 0) for t in (0.3, 0.7, 1.0, 1.3, 2.0, 1e-7, 5.0)]
    got = _weights(torch.from_numpy(rows), specs).numpy()
    for row, spec, g in zip(rows, specs, got):
        assert np.array_equal(g, sampling.weights(row, spec.temperature))


def test_weights_and_thresholds_are_exact():
    row = np.log(np.array([0.5, 0.25, 0.125, 0.0], dtype=np.float64) + 1e-300).astype(np.float32)
    w = sampling.weights(row, 1.0)
    assert w[0] == 1 << sampling.WEIGHT_BITS and w[3] == 0  # the best weighs 2^40; the tail nothing
    assert abs(w[1] / w[0] - 0.5) < 1e-6 and abs(w[2] / w[0] - 0.25) < 1e-6
    assert sampling.min_p_floor(0.5) == 1 << (sampling.WEIGHT_BITS - 1) and sampling.min_p_floor(0.0) == 1
    assert sampling.nucleus_mass(0.5, 7) == 4 and sampling.nucleus_mass(1.0, 7) == 7
    assert sampling.draw_point(0.0, 10) == 0 and sampling.draw_point(np.nextafter(1.0, 0.0), 10) == 9
    # Every id tied: the nucleus floor never rises above the best's weight (top_p 0 keeps one).
    flat = np.zeros(2000, dtype=np.float32)
    assert sampling.candidates(flat, LaneParams(temperature=1.0, top_p=0.0))[0].tolist() == [0]
    with pytest.raises(ValueError, match="at most"):
        sampling.weights(np.zeros(sampling.MAX_VOCAB + 1, dtype=np.float32), 1.0)


def test_ties_at_the_edges_keep_the_lowest_ids():
    """At the top-k edge and at the nucleus's edge, whichever sampler."""
    row = np.zeros(V, dtype=np.float32)
    row[[7, 300]] = 1.0
    p = LaneParams(temperature=1.0, top_k=4)
    assert sampling.candidates(row, p)[0].tolist() == [7, 300, 0, 1]  # the walk: heaviest, then lowest ids
    flat = np.zeros(2000, dtype=np.float32)  # every weight tied
    ids, _ = sampling.candidates(flat, LaneParams(temperature=1.0, top_p=0.4))
    # top_p is the float 0.4 (a hair above 2/5), exactly: 800 of 2000 fall short, 801 reach it.
    assert ids.tolist() == list(range(801))


def test_torch_sampler_edges():
    row = np.zeros(V, dtype=np.float32)  # all tied: greedy and top-k 1 take id 0; top-p the lowest ids
    specs = [SampleSpec(0.0, 0, 1.0, 0.0, 1), SampleSpec(1.0, 1, 1.0, 0.0, 2), SampleSpec(1.0, 0, 0.5, 0.0, 3),
             SampleSpec(1.0, 0, 1.0, 0.0, 4)]
    got = sample_lanes(torch.from_numpy(np.stack([row] * 4)), specs, batched=True)
    assert got[:2] == [0, 0] and got[2] < V // 2
    assert got == [host(row, s) for s in specs]
    # u close to 1 takes the last candidate; u close to 0 the first.
    pos_hi = next(p for p in range(1 << 16) if sampling.uniform(p) > 0.999)
    pos_lo = next(p for p in range(1 << 16) if sampling.uniform(p) < 0.001)
    row = np.full(V, -np.inf, dtype=np.float32)
    row[[3, 40, 700]] = [1.0, 2.0, 0.5]
    specs = [SampleSpec(1.0, 0, 1.0, 0.0, pos_hi), SampleSpec(1.0, 0, 1.0, 0.0, pos_lo),
             SampleSpec(1.0, 0, 0.99, 0.0, pos_hi), SampleSpec(1.0, 5, 1.0, 0.0, pos_hi)]
    got = sample_lanes(torch.from_numpy(np.stack([row] * 4)), specs, batched=True)
    assert got == [700, 3, 700, 700] == [host(row, s) for s in specs]


@pytest.fixture(scope="module")
def rt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    TinyModel().write_gguf(d / "llama.gguf")
    return TorchRuntime(d / "llama.gguf", dtype="float32", quant="none", kv_cache_mb=4)


def test_step_sampled_mixed_lanes_match_host_sampling(rt):
    prompt = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]
    rng = np.random.default_rng(7)
    specs = [SampleSpec(0.0, 0, 1.0, 0.0, 0), SampleSpec(0.8, 0, 0.95, 0.0, 12345),
             SampleSpec(1.3, 20, 1.0, 0.05, 999), SampleSpec(0.5, 5, 0.5, 0.0, 7),
             SampleSpec(0.0, 0, 1.0, 0.0, 3), SampleSpec(2.0, 0, 1.0, 0.0, 1 << 40),
             SampleSpec(1.0, 1, 1.0, 0.0, 5), SampleSpec(0.7, 50, 0.9, 0.1, 77)]
    specs += [random_spec(rng) for _ in range(8)]
    a, b = [rt.seq_create() for _ in specs], [rt.seq_create() for _ in specs]
    rt.step([Feed(s, prompt[i % 12: i % 12 + 6], False) for i, s in enumerate(a)]
            + [Feed(s, prompt[i % 12: i % 12 + 6], False) for i, s in enumerate(b)])
    toks = [i + 1 for i in range(len(specs))]
    for _ in range(3):  # a few decode steps: the lanes feed back their sampled tokens
        rows = rt.step([Feed(s, [t], True) for s, t in zip(b, toks)])
        toks = rt.step_sampled([Feed(s, [t], True) for s, t in zip(a, toks)], specs)
        assert toks == [host(row, sp) for row, sp in zip(rows, specs)]
        specs = [SampleSpec(s.temperature, s.top_k, s.top_p, s.min_p, s.rng_position + 1) for s in specs]
    for s in a + b:
        rt.seq_free(s)
