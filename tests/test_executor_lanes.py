"""Recurrent checkpoints, host sampling, grammars, faults and the fatal path."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from superfluid.abi import (
    FaultCode,
    Finish,
    HostCommit,
    LaneAdmit,
    LaneDecode,
    PrefillChunk,
    Sampling,
    LaneParams,
    Status,
    TickPlan,
    TickStatus,
)
from superfluid.executor import Executor, ExecutorConfig
from superfluid.runtimes.base import Fatal, Fault
from superfluid.runtimes.toy import ToyRuntime

from lane_driver import Driver, LaneRun
from test_executor_equivalence import prompt_of, reference

# ---------------------------------------------------------------- exact_only


class NoPartialTruncate(ToyRuntime):
    """Records every truncate so the test can prove none was partial."""

    def __init__(self, **kw):
        super().__init__(exact_only=True, **kw)
        self.truncates = []

    def seq_truncate(self, seq, n):
        self.truncates.append((self.seq_len(seq), n))
        super().seq_truncate(seq, n)


def test_checkpoint_lands_one_token_before_the_prompt_end():
    rt = NoPartialTruncate()
    ex = Executor(rt)
    prompt = prompt_of(150)
    d = Driver(ex)
    d.add(LaneRun(1, prompt, 5, chunk=64))
    d.run()
    keys = [e.tokens for e in ex.cache]
    assert keys == [prompt[:-1]]
    # a resent prompt starts from the checkpoint and gives the same tokens
    lease = d.lease(prompt)
    assert lease.prefix_len == len(prompt) - 1
    run = d.add(LaneRun(2, prompt, 5, lease_handle=lease.handle))
    d.run()
    assert run.out == d.lanes[1].out
    assert all(n in (0, length) for length, n in rt.truncates)


def test_next_turn_starts_from_the_published_state():
    rt = NoPartialTruncate()
    ex = Executor(rt)
    prompt = prompt_of(140)
    d = Driver(ex)
    first = d.add(LaneRun(1, prompt, 6))
    d.run()
    d.retire([1])
    turn1 = prompt + first.out
    assert [e.tokens for e in ex.cache if len(e.tokens) == len(turn1)] == [turn1]
    nxt = turn1 + prompt_of(9, salt=3)
    lease = d.lease(nxt)
    assert lease.prefix_len == len(turn1)  # exact: the whole previous turn
    run = d.add(LaneRun(2, nxt, 10, lease_handle=lease.handle))
    d.run()
    assert run.out == reference(LaneParams(), Sampling.GREEDY, nxt, n=10, exact_only=True)
    assert all(n in (0, length) for length, n in rt.truncates)


def test_exact_only_runtime_refuses_partial_truncate():
    from superfluid.runtimes.base import Feed, Unsupported

    rt = ToyRuntime(exact_only=True)
    s = rt.seq_create()
    rt.step([Feed(s, [4, 5, 6], False)])
    with pytest.raises(Unsupported):
        rt.seq_truncate(s, 2)
    assert rt.seq_len(s) == 3  # the state is untouched
    rt.seq_truncate(s, 0)
    assert rt.seq_len(s) == 0


# ------------------------------------------------------------ host sampling


def _host_setup():
    ex = Executor(ToyRuntime())
    r = ex.rings
    r.begin_prompts()
    prompt = prompt_of(20)
    ref = r.write_prompt(prompt)
    out = ex.run_tick(
        TickPlan(1, admits=[LaneAdmit(1, ref, Sampling.HOST)], prefills=[PrefillChunk(1, 0, 20)], decodes=[LaneDecode(1, 1)])
    )
    assert out.status == Status.OK
    emit = out.events.emits[0]
    assert emit.n_tokens == 0 and emit.logits_row.length == 1
    return ex, prompt, emit.logits_row


def test_host_row_carries_a_nonce_and_a_commit_continues_the_lane():
    ex, prompt, row_ref = _host_setup()
    row = ex.rings.read_logits_row(row_ref)
    assert row.shape == (ex.desc.vocab_size,)
    token = int(np.argmax(row))
    out = ex.run_tick(TickPlan(2, commits=[HostCommit(1, token, row_ref.generation)], decodes=[LaneDecode(1, 1)]))
    assert out.status == Status.OK
    assert ex.lane_tokens(1) == prompt + [token]
    nxt = out.events.emits[0].logits_row
    assert nxt.generation != row_ref.generation


def test_stale_nonce_is_rejected():
    ex, prompt, row_ref = _host_setup()
    before = ex.snapshot()
    out = ex.run_tick(TickPlan(2, commits=[HostCommit(1, 5, row_ref.generation - 1)], decodes=[LaneDecode(1, 1)]))
    assert out.status == Status.REJECT_STALE_NONCE
    assert ex.snapshot() == before


# ---------------------------------------------------------------- grammars

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "n": {"type": "integer"}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"],
}


def _grammar_run(ex, handle, tag, prompt, n=300, replay=0, sampling=Sampling.SAMPLE):
    return LaneRun(tag, prompt, n, sampling=sampling, params=LaneParams(temperature=0.7), rounds=16,
                   grammar_handle=handle, grammar_replay=replay, rng_base=5 + tag)


def test_json_schema_grammar_output_validates():
    ex = Executor(ToyRuntime())
    h = ex.compile_grammar("json_schema", json.dumps(SCHEMA))
    d = Driver(ex)
    run = d.add(_grammar_run(ex, h, 1, prompt_of(12)))
    d.run()
    assert run.finish == Finish.GRAMMAR
    text = ex.prim.tokenizer.decode(run.out)
    obj = json.loads(text)
    assert set(obj) == {"name", "n", "ok"} and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 6


def test_grammar_replay_rebuilds_the_cursor():
    ex = Executor(ToyRuntime())
    h = ex.compile_grammar("json_schema", json.dumps(SCHEMA))
    d = Driver(ex)
    whole = d.add(_grammar_run(ex, h, 1, prompt_of(12)))
    d.run()
    cut = len(whole.out) // 2
    h2 = ex.compile_grammar("json_schema", json.dumps(SCHEMA))
    rebuilt = LaneRun(2, prompt_of(12) + whole.out[:cut], 300, sampling=Sampling.SAMPLE, params=LaneParams(temperature=0.7),
                      rounds=16, grammar_handle=h2, grammar_replay=cut, decode_replay=cut, rng_base=6)
    d.add(rebuilt)
    d.run()
    assert whole.out[:cut] + rebuilt.out == whole.out


def test_grammar_overflow_faults_only_that_lane():
    ex = Executor(ToyRuntime())
    # The toy vocabulary cannot spell this regex's next character: the mask is empty.
    h = ex.compile_grammar("regex", "ab\u00ff")
    d = Driver(ex)
    bad = d.add(_grammar_run(ex, h, 1, prompt_of(10)))
    good = d.add(LaneRun(2, prompt_of(10, 2), 20, rounds=4))
    d.run()
    assert bad.fault == FaultCode.GRAMMAR_OVERFLOW
    assert len(good.out) == 20 and good.fault == 0
    assert any(ev.tick_status == TickStatus.LANE_ERRORS for ev in d.events)
    assert d.retire([1, 2]).tick_status == TickStatus.OK  # a faulted lane's retire is accepted


# ------------------------------------------------------------------ faults


def test_injected_fault_removes_only_that_lane():
    ex = Executor(ToyRuntime())
    d = Driver(ex)
    runs = [d.add(LaneRun(i, prompt_of(15, i), 12, rounds=3)) for i in (1, 2, 3)]
    d.tick()
    ex.inject_fault(2, FaultCode.INJECTED + 7)
    d.run()
    assert runs[1].fault == FaultCode.INJECTED + 7
    assert 2 not in ex.lanes
    for r in (runs[0], runs[2]):
        assert r.fault == 0 and r.out == reference(LaneParams(), Sampling.GREEDY, r.prompt, n=12)
    assert set(ex.prim.seqs) == {ex.lanes[1].seq, ex.lanes[3].seq}


def test_runtime_fault_in_a_step_faults_the_step_lanes():
    rt = ToyRuntime()
    ex = Executor(rt)
    d = Driver(ex)
    a = d.add(LaneRun(1, prompt_of(15), 8))
    d.tick()
    rt.fail_on("step", Fault(FaultCode.INTERNAL))
    ev = d.tick()
    assert ev.tick_status == TickStatus.LANE_ERRORS and a.fault == FaultCode.INTERNAL
    assert not rt.seqs


def test_fatal_error_answers_fatal_in_process():
    rt = ToyRuntime()
    ex = Executor(rt, config=ExecutorConfig(fatal_exit=False))
    d = Driver(ex)
    d.add(LaneRun(1, prompt_of(15), 8))
    rt.fail_on("step", Fatal("device lost"))
    out = ex.run_tick(d.plan())
    assert out.status == Status.FATAL


def test_fatal_error_exits_70_in_a_worker():
    code = (
        "from superfluid.executor import Executor\n"
        "from superfluid.runtimes.toy import ToyRuntime\n"
        "from superfluid.runtimes.base import Fatal\n"
        "import sys; sys.path.insert(0, 'tests')\n"
        "from lane_driver import Driver, LaneRun\n"
        "rt = ToyRuntime(); ex = Executor(rt); d = Driver(ex)\n"
        "d.add(LaneRun(1, [5, 6, 7, 8], 4)); rt.fail_on('step', Fatal('gone'))\n"
        "ex.run_tick(d.plan()); print('not reached')\n"
    )
    root = os.path.dirname(os.path.dirname(__file__))
    p = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "SUPERFLUID_FATAL_EXIT": "1"},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 70, p.stderr
    assert "not reached" not in p.stdout and "daemon starts a clean one" in p.stderr


def _partial_tick(**admit):
    """One lane admitted, prefilled and decoded 6 rounds in one tick with partial emits:
    (what the callback got, the events' tokens, the events)."""
    ex = Executor(ToyRuntime())
    r = ex.rings
    r.begin_prompts()
    ref = r.write_prompt(prompt_of(10))
    got = []
    out = ex.run_tick(
        TickPlan(1, flags=2, admits=[LaneAdmit(1, ref, **admit)], prefills=[PrefillChunk(1, 0, 10)],
                 decodes=[LaneDecode(1, 6)]),
        on_partial_emit=got.append,
    )
    return got, r.read_emits(out.events.emits[0].token_ref), out.events


def test_partial_emits_reach_the_callback_in_order():
    got, tokens, _ = _partial_tick()
    assert [e.token for e in got] == tokens and len(got) == 6 and {e.lane_tag for e in got} == {1}


def test_partial_emits_carry_what_the_events_say():
    """A partial emit carries the token's logprob: the scheduler needs nothing else of
    the events' tokens."""
    got, tokens, events = _partial_tick(sampling=Sampling.SAMPLE, params=LaneParams(temperature=0.8),
                                        rng_counter_base=3, want_logprobs=4)
    assert [e.token for e in got] == tokens
    assert [e.logprob for e in got] == events.logprobs and all(e.logprob is not None for e in got)


def test_logprobs_come_with_each_token():
    ex = Executor(ToyRuntime())
    d = Driver(ex)
    run = d.add(LaneRun(1, prompt_of(10), 8, sampling=Sampling.SAMPLE, params=LaneParams(temperature=0.8), want_logprobs=6, rng_base=3))
    d.run()
    assert [lp.token_id for lp in run.logprobs] == run.out
    for lp in run.logprobs:
        assert len(lp.top_ids) == 5 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert lp.logprob <= lp.top_logprobs[0] + 1e-9


def test_logit_bias_bans_a_token():
    want = reference(LaneParams(), Sampling.GREEDY, prompt_of(10), n=10)
    ex = Executor(ToyRuntime())
    h = ex.register_logit_bias({want[0]: -100.0})
    d = Driver(ex)
    run = d.add(LaneRun(1, prompt_of(10), 10, logit_bias_handle=h))
    d.run()
    assert want[0] not in run.out


def test_export_and_import_entries_round_trip():
    ex = Executor(ToyRuntime())
    d = Driver(ex)
    d.add(LaneRun(1, prompt_of(40), 4))
    d.run()
    d.retire([1])
    [entry] = ex.cache.entries
    assert ex.export_entries() == [entry.entry_id] and entry.seq is None
    ev = d.tick(d.plan())
    assert [c.op for c in ev.op_completions] == [1] and ev.mem.host_retained_bytes == entry.bytes
    # a seed from the exported entry imports it and gives the same tokens
    lease = d.lease(prompt_of(40))
    run = d.add(LaneRun(2, prompt_of(40), 6, lease_handle=lease.handle))
    d.run()
    assert run.out == reference(LaneParams(), Sampling.GREEDY, prompt_of(40), n=6)


def test_failed_import_prefills_afresh():
    rt = ToyRuntime()
    ex = Executor(rt)
    d = Driver(ex)
    d.add(LaneRun(1, prompt_of(40), 4))
    d.run()
    d.retire([1])
    ex.export_entries()
    lease = d.lease(prompt_of(40))
    rt.fail_on("seq_import", Fault(FaultCode.INTERNAL))
    run = d.add(LaneRun(2, prompt_of(40), 6, lease_handle=lease.handle))
    d.run()
    assert run.out == reference(LaneParams(), Sampling.GREEDY, prompt_of(40), n=6)
    assert not ex.cache.entries  # the entry whose state was lost is gone


def test_full_emit_ring_faults_the_lane_with_ref_span_oob():
    from superfluid.rings import Rings

    rt = ToyRuntime()
    ex = Executor(rt, Rings(rt.desc.vocab_size, token_capacity=12))
    d = Driver(ex)
    a = d.add(LaneRun(1, prompt_of(6), 20, rounds=8))
    b = d.add(LaneRun(2, prompt_of(6, 1), 20, rounds=8))
    d.tick()
    assert a.fault == 0 and b.fault == FaultCode.REF_SPAN_OOB  # 8 + 8 tokens into a 12-token ring


class SlowVerify(ToyRuntime):
    """Verification costs far more than a plain step: drafting cannot pay."""

    def step_rows(self, feeds):
        import time

        time.sleep(0.02)
        return super().step_rows(feeds)


def test_spec_gate_turns_drafting_off_when_it_does_not_pay():
    from superfluid.executor import SpecConfig

    ex = Executor(SlowVerify())
    slot = ex.load_strategy(SpecConfig(max_depth=4, gate_samples=2, gate_refresh=10_000))
    d = Driver(ex)
    prompt = (prompt_of(10) * 6)[:55]
    run = d.add(LaneRun(1, prompt, 120, rounds=4, strategy_slot=slot))
    d.run()
    drafted = [sum(e.spec.proposed for e in ev.emits) > 0 for ev in d.events]
    assert any(drafted[:6])  # measured on at first
    assert not any(drafted[-10:])  # then the gate keeps it off
    assert run.out == reference(LaneParams(), Sampling.GREEDY, prompt, n=120)


# ---------------------------------------------------------------- riders


class CountingSteps(ToyRuntime):
    """Records the feeds of every step so a test can see which lanes shared one."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed: list[list[tuple[int, int]]] = []  # per step: (seq, tokens fed)

    def step(self, feeds):
        self.fed.append([(f.seq, len(f.tokens)) for f in feeds])
        return super().step(feeds)

    def step_sampled(self, feeds, specs):
        self.fed.append([(f.seq, len(f.tokens)) for f in feeds])
        return super().step_sampled(feeds, specs)


def test_running_lanes_ride_in_the_prefill_step_and_keep_their_text():
    rt = CountingSteps(max_batch=4)
    ex = Executor(rt)
    d = Driver(ex)
    a = d.add(LaneRun(1, prompt_of(15, 1), 10, rounds=1))
    b = d.add(LaneRun(2, prompt_of(15, 2), 10, rounds=1))
    d.tick()  # both prefill and take their first token
    d.tick()  # both decode one round alone
    c_run = d.add(LaneRun(3, prompt_of(40, 3), 10, rounds=1))
    rt.fed.clear()
    d.tick()  # c prefills; a and b ride along in that step instead of a round of their own
    seq_c = ex.lanes[3].seq
    assert len(rt.fed) == 1, rt.fed
    assert sorted(rt.fed[0]) == sorted([(ex.lanes[1].seq, 1), (ex.lanes[2].seq, 1), (seq_c, 40)])
    d.run()
    for r in (a, b, c_run):
        assert r.fault == 0 and r.out == reference(LaneParams(), Sampling.GREEDY, r.prompt, n=10)


def test_riders_never_exceed_max_batch():
    rt = CountingSteps(max_batch=2)
    ex = Executor(rt)
    d = Driver(ex)
    runs = [d.add(LaneRun(i, prompt_of(15, i), 6, rounds=1)) for i in (1, 2)]
    d.tick()
    d.tick()
    runs.append(d.add(LaneRun(3, prompt_of(30, 3), 6, rounds=1)))
    rt.fed.clear()
    d.tick()
    assert rt.fed and all(len(s) <= 2 for s in rt.fed), rt.fed
    d.run()
    for r in runs:
        assert r.fault == 0 and r.out == reference(LaneParams(), Sampling.GREEDY, r.prompt, n=6)
