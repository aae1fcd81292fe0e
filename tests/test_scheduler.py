"""The scheduler on the toy runtime: batching, chunking, seeds, preemption, faults."""

from __future__ import annotations

from superfluid import abi
from superfluid.engine.config import EngineConfig, SchedulerConfig
from superfluid.engine.engine import Engine
from superfluid.engine.params import SamplingParams
from superfluid.engine.request import FinishReason
from superfluid.executor import Executor
from superfluid.rings import Rings
from superfluid.runtimes.toy import ToyRuntime


class Recorder:
    """Wraps an executor and keeps every plan it was given, with the status."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.plans: list[tuple[abi.TickPlan, int]] = []

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def run_tick(self, plan, on_partial_emit=None):
        out = self.ex.run_tick(plan, on_partial_emit)
        self.plans.append((plan, out.status))
        return out

    def accepted(self) -> list[abi.TickPlan]:
        return [p for p, s in self.plans if s == abi.Status.OK]


def make_engine(scheduler: SchedulerConfig = SchedulerConfig(), **toy) -> tuple[Engine, Recorder]:
    rt = ToyRuntime(**toy)
    rings = Rings(rt.desc.vocab_size)
    ex = Recorder(Executor(rt, rings))
    eng = Engine(ex, rings, rt.tokenizer, EngineConfig(runtime="toy", scheduler=scheduler))
    # Every delta, as it happens (this also streams tokens through PARTIAL_EMITS).
    eng.collected = {}
    eng.stream_to(lambda d: _collect(eng.collected, d))
    return eng, ex


def _collect(outs: dict, d) -> None:
    o = outs.setdefault(f"{d.request_id}/{d.index}", {"text": "", "ids": [], "finish": None, "error": None})
    o["text"] += d.text
    o["ids"] += d.token_ids
    if d.finish_reason:
        o["finish"], o["error"] = d.finish_reason, d.error


def run(engine: Engine, max_steps: int = 10_000) -> dict[str, dict]:
    """Step until idle; per choice (request id/index): text, token ids, finish reason."""
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), "the engine did not settle"
    return engine.collected


def prompt(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=48, ignore_eos=True)


def test_continuous_batching_admits_while_others_decode():
    eng, ex = make_engine(SchedulerConfig(prefill_token_budget=16))
    eng.add_request("a", prompt(eng, "the first request"), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    eng.add_request("b", prompt(eng, "a second one, " * 3), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    eng.step()
    plan = ex.accepted()[-1]
    assert len(plan.admits) == 1 and [d.lane_tag for d in plan.decodes] != []  # b admitted, a still decoding
    # b is still prefilling (its first token waits): a gets one round per tick meanwhile
    assert [d.max_new_tokens for d in plan.decodes] == [1]
    outs = run(eng)
    assert len(outs["a/0"]["ids"]) == 30 and len(outs["b/0"]["ids"]) == 5
    # with nobody waiting, a lane gets several rounds per tick
    assert max(d.max_new_tokens for p in ex.accepted() for d in p.decodes) == 8


def test_prefill_is_chunked_under_the_token_budget():
    eng, ex = make_engine(SchedulerConfig(prefill_token_budget=16), max_seq_len=512)
    ids = prompt(eng, "x" * 50)
    eng.add_request("a", ids, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    run(eng)
    chunks = [(c.token_offset, c.token_count) for p in ex.accepted() for c in p.prefills]
    assert chunks == [(0, 16), (16, 16), (32, 16), (48, 2)]
    # the lane decodes first in the tick that completes its prefill
    first_decode = next(i for i, p in enumerate(ex.accepted()) if p.decodes)
    assert first_decode == 3


def test_chunked_prefill_gives_the_same_tokens_as_one_chunk():
    outs = []
    for budget in (7, 4096):
        eng, _ = make_engine(SchedulerConfig(prefill_token_budget=budget))
        eng.add_request("a", prompt(eng, "some prompt that is long enough " * 3), SAMPLED)
        outs.append(run(eng)["a/0"]["ids"])
    assert outs[0] == outs[1]


def test_prefix_cache_seeds_the_second_request():
    eng, ex = make_engine()
    shared = "a shared system prompt, long enough to span pages. " * 2
    eng.add_request("a", prompt(eng, shared + "first"), SAMPLED)
    a = run(eng)["a/0"]
    reqs = eng.add_request("b", prompt(eng, shared + "second"), SAMPLED)
    b = run(eng)["b/0"]
    page = ex.desc.page
    n_shared = len(prompt(eng, shared))
    assert reqs[0].cached_tokens >= (n_shared // page - 1) * page > 0
    assert any(adm.lease_handle for p in ex.accepted() for adm in p.admits)
    # The same prompt again: seeded, and the same tokens as its first run.
    again = eng.add_request("c", prompt(eng, shared + "first"), SAMPLED)
    c = run(eng)["c/0"]
    assert c["ids"] == a["ids"] and again[0].cached_tokens > 0
    assert b["ids"] != a["ids"]


def test_n_choices_differ_and_repeat_with_the_seed():
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=20, ignore_eos=True)
    runs = []
    for _ in range(2):
        eng, _ = make_engine()
        eng.add_request("a", prompt(eng, "pick something"), params)
        outs = run(eng)
        runs.append((outs["a/0"]["ids"], outs["a/1"]["ids"]))
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_preemption_replays_to_the_same_tokens():
    prompts = ["first prompt here", "second prompt, a bit longer", "third", "fourth one"]
    want = {}
    eng, _ = make_engine()
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt(eng, p), SAMPLED.with_(seed=i))
    want = run(eng)
    # A pool that holds about two of the four at their full length.
    eng, ex = make_engine(n_cells=160, page=4)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt(eng, p), SAMPLED.with_(seed=i))
    got = run(eng)
    assert eng.scheduler.stats.preemptions > 0
    replays = [a.decode_replay for p in ex.accepted() for a in p.admits if a.decode_replay]
    assert replays, "a preempted request came back with decode_replay"
    for key in want:
        assert got[key]["ids"] == want[key]["ids"], key
        assert got[key]["finish"] == "length"


def test_a_request_too_big_for_the_pool_fails_alone():
    eng, _ = make_engine(n_cells=64, page=4, max_seq_len=512)
    eng.add_request("big", prompt(eng, "y" * 100), SamplingParams(temperature=0, max_tokens=4))
    eng.add_request("small", prompt(eng, "hi"), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outs = run(eng)
    assert outs["big/0"]["finish"] == "error" and "KV" in outs["big/0"]["error"]
    assert outs["small/0"]["finish"] == "length" and len(outs["small/0"]["ids"]) == 4


def test_a_fault_fails_that_request_only():
    base_eng, _ = make_engine()
    for r in "abc":
        base_eng.add_request(r, prompt(base_eng, f"request {r}"), SAMPLED)
    want = run(base_eng)

    eng, ex = make_engine()
    reqs = {r: eng.add_request(r, prompt(eng, f"request {r}"), SAMPLED)[0] for r in "abc"}
    eng.step()
    ex.ex.inject_fault(reqs["b"].lane_tag, abi.FaultCode.INJECTED)
    got = run(eng)
    assert got["b/0"]["finish"] == "error"
    assert reqs["b"].finish_reason is FinishReason.ERROR
    for r in "ac":
        assert got[f"{r}/0"]["ids"] == want[f"{r}/0"]["ids"]


def test_an_oom_fault_readmits_the_request():
    base, _ = make_engine()
    base.add_request("a", prompt(base, "out of memory"), SAMPLED)
    want = run(base)["a/0"]["ids"]
    eng, ex = make_engine()
    req = eng.add_request("a", prompt(eng, "out of memory"), SAMPLED)[0]
    for _ in range(3):
        eng.step()
    ex.ex.inject_fault(req.lane_tag, abi.FaultCode.OOM_TENTATIVE)
    got = run(eng)["a/0"]
    assert got["finish"] == "length" and got["ids"] == want
    assert req.num_oom_retries == 1


def test_abort_retires_the_lane_at_the_next_tick():
    eng, ex = make_engine()
    req = eng.add_request("a", prompt(eng, "abort me"), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))[0]
    eng.step()
    tag = req.lane_tag
    eng.abort("a")
    eng.step()
    assert [r.lane_tag for r in ex.accepted()[-1].retires] == [tag]
    assert not eng.has_work()
    assert tag not in ex.ex.lanes


def test_priority_runs_first_and_fcfs_among_equals():
    eng, ex = make_engine(SchedulerConfig(max_running=1))
    eng.stream_to(None)  # deltas after each tick, from the outbox
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    eng.add_request("late-low", prompt(eng, "one"), p.with_(priority=5))
    eng.add_request("first", prompt(eng, "two"), p)
    eng.add_request("second", prompt(eng, "three"), p)
    order = []
    while eng.has_work():
        eng.step()
        for d in eng.output.take():
            if d.finish_reason:
                order.append(d.request_id)
    assert order == ["first", "second", "late-low"]


def test_yield_flag_cuts_prefill_and_the_scheduler_replans_from_progress():
    eng, ex = make_engine(SchedulerConfig(prefill_token_budget=4096), prefill_step_tokens=8)
    ids = prompt(eng, "z" * 64)
    eng.add_request("a", ids, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    real = ex.ex.prim.step
    calls = {"n": 0}

    def step(feeds):
        calls["n"] += 1
        if calls["n"] == 2:
            eng.rings.request_yield(True)  # as a request arriving mid-tick would
        return real(feeds)

    ex.ex.prim.step = step
    outs = run(eng)
    offsets = [c.token_offset for p in ex.accepted() for c in p.prefills]
    assert offsets[0] == 0 and offsets[1] == 16  # two steps of 8 ran before the yield
    assert len(outs["a/0"]["ids"]) == 3


# -------------------------------------------------- hand-made events (vLLM style)


class FakeExecutor:
    """Answers plans from a script; checks nothing. Enough to drive the scheduler."""

    def __init__(self, desc, script):
        self.desc = desc
        self.script = list(script)
        self.plans = []

    def lease_prefix(self, *a, **k):
        return None

    def run_tick(self, plan, on_partial_emit=None):
        self.plans.append(plan)
        return self.script.pop(0)(plan)

    def release_logit_bias(self, h):
        pass

    def release_grammar(self, h):
        pass


def _events(plan, emits=(), shed=(), faults=()):
    return abi.TickOutcome(
        abi.Status.OK,
        abi.TickEvents(
            plan_seq=plan.plan_seq,
            tick_status=0,
            admit_results=[],
            emits=list(emits),
            faults=list(faults),
            shed=abi.ShedReport(entries=list(shed)),
            op_completions=[],
            timings=abi.TickTimings(),
            mem=abi.TickMemCounters(),
            logprobs=[],
        ),
    )


def test_hand_made_needs_replan_then_shed_chunk():
    from superfluid.engine.request import Request
    from superfluid.engine.scheduler import Scheduler
    from superfluid.runtimes.base import RuntimeDesc

    desc = RuntimeDesc("fake", vocab_size=100, max_batch=4, max_seq_len=256)
    rings = Rings(100)

    def needs_replan(plan):
        assert len(plan.admits) == 2
        return abi.TickOutcome(abi.Status.NEEDS_REPLAN)

    def one_admit_cut(plan):
        assert len(plan.admits) == 1  # the second admission was dropped
        (chunk,) = plan.prefills
        assert (chunk.token_offset, chunk.token_count) == (0, 40)
        shed = abi.ShedEntry(chunk.lane_tag, abi.ShedKind.PREFILL_CHUNK, 0, 0, 30)
        return _events(plan, shed=[shed])

    def resumes_at_progress(plan):
        chunks = {c.lane_tag: (c.token_offset, c.token_count) for c in plan.prefills}
        assert list(chunks.values())[0] == (10, 30)  # re-planned from what was prefilled
        return abi.TickOutcome(abi.Status.NEEDS_REPLAN)

    ex = FakeExecutor(desc, [needs_replan, one_admit_cut, resumes_at_progress, lambda p: _events(p)])
    s = Scheduler(ex, rings, SchedulerConfig(prefill_token_budget=64))
    p = SamplingParams(temperature=0, max_tokens=4)
    r1 = Request("r1", list(range(1, 41)), p, max_new_tokens=4)
    r2 = Request("r2", list(range(1, 31)), p, max_new_tokens=4)
    s.add(r1)
    s.add(r2)
    s.step()
    assert r1.prefilled == 10 and r2.lane_tag is None
    s.step()  # NeedsReplan again: drops r2's admission, keeps r1's chunk
    assert ex.plans[-1].admits == [] and r1.prefilled == 40  # the re-plan without r2 went through


def test_hand_made_needs_replan_cuts_rounds_then_preempts_the_newest():
    from superfluid.engine.lifecycle import Phase
    from superfluid.engine.request import Request
    from superfluid.engine.scheduler import Scheduler
    from superfluid.runtimes.base import RuntimeDesc

    desc = RuntimeDesc("fake", vocab_size=100, max_batch=4, max_seq_len=256)
    rings = Rings(100)

    def emit_one(plan):
        rings.begin_output()
        emits = [abi.LaneEmit(d.lane_tag, rings.write_tokens([7]), 1, 0, abi.RingRef(), abi.SpecStats()) for d in plan.decodes]
        return _events(plan, emits=emits)

    def eight_rounds_do_not_fit(plan):
        assert {d.max_new_tokens for d in plan.decodes} == {8}
        return abi.TickOutcome(abi.Status.NEEDS_REPLAN)

    def one_round_does_not_fit(plan):
        assert {d.max_new_tokens for d in plan.decodes} == {1}
        return abi.TickOutcome(abi.Status.NEEDS_REPLAN)

    def after_preemption(plan):
        (retire,) = plan.retires
        assert retire.lane_tag == tags["new"] and not retire.publish_to_cache
        assert [d.lane_tag for d in plan.decodes] == [tags["old"]]
        return emit_one(plan)

    ex = FakeExecutor(desc, [emit_one, eight_rounds_do_not_fit, one_round_does_not_fit, after_preemption])
    s = Scheduler(ex, rings, SchedulerConfig(max_rounds=8))
    p = SamplingParams(temperature=0, max_tokens=50)
    old = Request("old", [1, 2, 3], p, max_new_tokens=50, arrival=1.0)
    new = Request("new", [4, 5, 6], p, max_new_tokens=50, arrival=2.0)
    s.add(old)
    s.add(new)
    s.step()  # both admitted, prefilled, one token each
    tags = {"old": old.lane_tag, "new": new.lane_tag}
    s.step()
    assert new.phase is Phase.PREEMPTED and new.output_token_ids == [7] and new.num_preemptions == 1
    assert old.output_token_ids == [7, 7]
    # the preempted request comes back with its token replayed
    ex.script.append(lambda plan: emit_one(plan))
    s.step()
    (adm,) = ex.plans[-1].admits
    assert adm.decode_replay == 1 and adm.rng_counter_base == new.rng_base
    assert ex.plans[-1].decodes[-1].max_new_tokens >= 2  # the replay and a new token


def test_speculative_lanes_draft_and_give_the_same_tokens():
    text = "abcabcabcabcabcabcabcabc"  # repetitive: prompt lookup finds drafts
    outs = []
    for spec in (False, True):
        eng, ex = make_engine(SchedulerConfig(speculative=spec))
        eng.add_request("a", prompt(eng, text), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        outs.append(run(eng)["a/0"]["ids"])
        if spec:
            assert all(a.strategy_slot for p in ex.accepted() for a in p.admits)
            assert eng.scheduler.stats.spec_proposed > 0
    assert outs[0] == outs[1]


def test_n_choices_fork_from_the_first_choices_cached_prompt():
    """n > 1 on a runtime whose copies share blocks: the prompt is prefilled once and
    the other choices fork from it, with the same tokens as without forking."""
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=12, ignore_eos=True)
    text = "a long enough prompt to fill several pages of the toy pool"
    eng, ex = make_engine(copy_shares_cells=True)
    eng.add_request("a", prompt(eng, text), params)
    outs = run(eng)
    plans = ex.accepted()
    admits = [a for p in plans for a in p.admits]
    prefilled = sum(c.token_count for p in plans for c in p.prefills)
    n_prompt = len(prompt(eng, text))
    assert [a.publish_prompt for a in admits] == [True, False, False]
    assert all(a.lease_handle for a in admits[1:])
    assert prefilled < n_prompt + 2 * ex.desc.page  # once, plus each fork's partial page
    eng2, _ = make_engine(copy_shares_cells=False)
    eng2.add_request("a", prompt(eng2, text), params)
    plain = run(eng2)
    assert [outs[f"a/{i}"]["ids"] for i in range(3)] == [plain[f"a/{i}"]["ids"] for i in range(3)]
