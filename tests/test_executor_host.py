"""The executor's side of host sampling beyond the seed: a host lane's row comes
processed (grammar mask, logit bias, penalties), a grammar advances over commits and
ends the lane there, and a rebuilt host lane replays before its one row."""

from __future__ import annotations

import numpy as np

from superfluid.abi import Finish, HostCommit, LaneAdmit, LaneDecode, PrefillChunk, Sampling, LaneParams, Status, TickPlan
from superfluid.executor import Executor
from superfluid import sampling as hs
from superfluid.runtimes.toy import ToyRuntime

from test_executor_equivalence import prompt_of


def _admit(ex, prompt, **kw):
    ex.rings.begin_prompts()
    ref = ex.rings.write_prompt(prompt)
    replay = kw.get("decode_replay", 0)
    end = len(prompt) - replay
    out = ex.run_tick(TickPlan(1, admits=[LaneAdmit(1, ref, Sampling.HOST, **kw)], prefills=[PrefillChunk(1, 0, end)],
                               decodes=[LaneDecode(1, 1 + replay)]))
    assert out.status == Status.OK, Status(out.status).name
    (emit,) = out.events.emits
    assert emit.n_tokens == 0 and emit.logits_row.length == 1
    return emit.logits_row


def test_a_host_row_arrives_with_bias_and_penalties_applied():
    prompt = prompt_of(12)
    raw = Executor(ToyRuntime())
    row_raw = raw.rings.read_logits_row(_admit(raw, prompt))
    ex = Executor(ToyRuntime())
    bias = ex.register_logit_bias({7: 4.0})
    params = LaneParams(presence_penalty=1.5)
    row = ex.rings.read_logits_row(_admit(ex, prompt, params=params, logit_bias_handle=bias))
    want = row_raw.copy()
    want[7] += 4.0
    exempt = frozenset([i for _, i in ex.prim.vocabulary().specials] + list(ex.prim.vocabulary().eos))
    hs.apply_penalties(want, prompt[-hs.PENALTY_WINDOW:], params, exempt)
    assert np.array_equal(row, want)


def test_a_grammar_masks_the_host_row_refuses_a_masked_commit_and_ends_the_lane():
    ex = Executor(ToyRuntime())
    g = ex.compile_grammar("regex", "ab")
    ref = _admit(ex, prompt_of(6), grammar_handle=g)
    row = ex.rings.read_logits_row(ref)
    tok = ex.prim.vocabulary().tokens
    allowed = [i for i in np.flatnonzero(np.isfinite(row))]
    assert allowed and all(tok[i] and b"ab".startswith(tok[i]) for i in allowed)
    masked = int(np.flatnonzero(~np.isfinite(row))[0])
    before = ex.snapshot()
    out = ex.run_tick(TickPlan(2, commits=[HostCommit(1, masked, ref.generation)], decodes=[LaneDecode(1, 1)]))
    assert out.status == Status.REJECT_HOST_RULES and ex.snapshot() == before
    # commit "a", then "b": the grammar is complete there and the lane finishes at the commit
    seq = 2
    for piece in (b"a", b"b"):
        t = tok.index(piece)
        seq += 1
        out = ex.run_tick(TickPlan(seq, commits=[HostCommit(1, t, ref.generation)], decodes=[LaneDecode(1, 1)]))
        assert out.status == Status.OK
        (emit,) = out.events.emits
        ref = emit.logits_row
    assert emit.finish == Finish.GRAMMAR and emit.logits_row.length == 0
    assert ex.lane_tokens(1)[-2:] == [tok.index(b"a"), tok.index(b"b")]


def test_a_rebuilt_host_lane_replays_then_sends_the_row_of_the_next_position():
    prompt, made = prompt_of(10), prompt_of(4, salt=3)
    fresh = Executor(ToyRuntime())
    want = fresh.rings.read_logits_row(_admit(fresh, prompt + made))  # prefilled whole
    ex = Executor(ToyRuntime())
    got = ex.rings.read_logits_row(_admit(ex, prompt + made, decode_replay=len(made)))
    assert np.allclose(got, want, atol=1e-6)
    assert ex.lanes[1].rng_counter == len(made)
