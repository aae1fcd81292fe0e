"""Host sampling, speculation proposals, the spec gate and the rings."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superfluid.abi import RingRef, LaneParams
from superfluid import sampling as hs
from superfluid.executor.speculate import LaneSpec, SpecConfig, SpecGate, propose
from superfluid.rings import PROMPTS, RingError, RingFull, Rings


def test_uniform_is_a_pure_function_of_the_position():
    us = [hs.uniform(p) for p in range(10000)]
    assert us == [hs.uniform(p) for p in range(10000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert abs(np.mean(us) - 0.5) < 0.01 and len(set(us)) == len(us)


def test_argmax_lowest_id_wins_ties():
    row = np.array([0.0, 3.0, 1.0, 3.0], dtype=np.float32)
    assert hs.argmax(row) == 1


@given(st.integers(0, 2**63), st.floats(0.1, 2.0), st.integers(0, 50), st.floats(0.05, 1.0), st.floats(0.0, 0.5))
@settings(max_examples=200, deadline=None)
def test_sample_respects_the_filters(pos, temp, top_k, top_p, min_p):
    row = np.random.default_rng(pos % 1000).standard_normal(100).astype(np.float32) * 3
    params = LaneParams(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)
    ids, p = hs.candidates(row, params)
    t = hs.sample(row, params, hs.uniform(pos))
    assert t in ids.tolist()
    if top_k:
        assert len(ids) <= top_k
    assert abs(p.sum() - 1.0) < 1e-9
    if min_p > 0:
        assert p.min() >= min_p * p.max() - 1e-12 or len(ids) == 1


def test_sampling_follows_the_distribution():
    row = np.log(np.array([0.5, 0.3, 0.2], dtype=np.float64)).astype(np.float32)
    params = LaneParams(temperature=1.0)
    counts = np.bincount([hs.sample(row, params, hs.uniform(p)) for p in range(6000)], minlength=3) / 6000
    assert np.allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    row = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    ids, _ = hs.candidates(row, LaneParams(temperature=1.0, top_p=0.75))
    assert ids.tolist() == [0, 1]


def test_penalties_skip_exempt_tokens_and_look_at_the_window():
    row = np.array([2.0, 2.0, -2.0, 2.0], dtype=np.float32)
    params = LaneParams(repeat_penalty=2.0, presence_penalty=0.5, freq_penalty=0.25)
    hs.apply_penalties(row, [0, 1, 1, 2], params, frozenset({0}))
    assert row[0] == 2.0  # exempt
    assert row[1] == pytest.approx(2.0 / 2 - 0.5 - 0.5)
    assert row[2] == pytest.approx(-2.0 * 2 - 0.5 - 0.25)
    assert row[3] == 2.0


def test_logprobs_top_k_sorted_and_normalised():
    row = np.random.default_rng(0).standard_normal(50).astype(np.float32)
    lp, top = hs.logprobs(row, 7, 20)
    assert len(top) == 20 and [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    full = hs.log_softmax(row)
    assert lp == pytest.approx(full[7]) and np.exp(full).sum() == pytest.approx(1.0)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    assert propose([1, 2, 3, 4, 9, 1, 2, 3], 2) == [4, 9]
    assert propose([5, 6, 7, 5, 6, 8, 5, 6], 3) == [8, 5, 6]  # the most recent occurrence
    assert propose([1, 2, 3], 4) == []


def test_lane_depth_adapts():
    cfg = SpecConfig(max_depth=6)
    ls = LaneSpec.new(cfg)
    d0 = ls.depth
    ls.record(cfg, d0, d0)
    assert ls.depth == d0 + 1
    for _ in range(3):
        ls.record(cfg, 3, 0)
    assert not ls.drafting()  # resting after repeated misses


def test_gate_keeps_drafting_only_where_it_paid():
    cfg = SpecConfig(gate_samples=2, gate_refresh=1000)
    g = SpecGate()
    for _ in range(2):
        assert g.allows(cfg, 1)
        g.record(cfg, 1, True, 0.010, 10)  # 1 ms/token with drafts
    assert not g.allows(cfg, 1)  # now measure without
    for _ in range(2):
        g.record(cfg, 1, False, 0.020, 10)  # 2 ms/token without
    assert g.allows(cfg, 1)
    # at 8 lanes drafting costs more
    for _ in range(2):
        g.record(cfg, 8, True, 0.050, 10)
        g.record(cfg, 8, False, 0.020, 10)
    assert not g.allows(cfg, 8) and g.allows(cfg, 1)
    # lane counts share a decision by powers of two: what 8 lanes measured holds for 9..15
    assert not g.allows(cfg, 11) and not g.allows(cfg, 15)
    assert g.allows(cfg, 16)  # 16 and up: not measured yet, so drafting is tried there


def test_rings_generations_bounds_and_full():
    r = Rings(vocab_size=8, token_capacity=16, logits_rows=2)
    r.begin_prompts()
    ref = r.write_prompt([1, 2, 3])
    assert r.read_tokens(ref) == [1, 2, 3]
    r.begin_prompts()
    with pytest.raises(RingError) as e:
        r.read_tokens(ref)
    assert e.value.kind == RingError.Kind.STALE
    with pytest.raises(RingError) as e:
        r.read_tokens(RingRef(PROMPTS, 0, 3, ref.generation + 1))
    assert e.value.kind == RingError.Kind.BOUNDS
    with pytest.raises(RingError) as e:
        r.read_tokens(RingRef(9, 0, 1, 1))
    assert e.value.kind == RingError.Kind.UNKNOWN_RING
    r.begin_output()
    with pytest.raises(RingFull):
        r.write_tokens(list(range(17)))
    assert r.read_emits(r.write_tokens([4, 5])) == [4, 5]
    r.set_latency_wanted(True)
    r.request_yield()
    assert r.latency_wanted() and r.yield_requested()
