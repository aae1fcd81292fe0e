"""Host-side sampling through ``LLM`` on the toy runtime: logits processors and samplers
on HOST lanes, beside engine-sampled lanes in the same ticks."""

from __future__ import annotations

import threading
import time
from collections import Counter

import numpy as np
import pytest

from superfluid import LLM, SamplingParams
from superfluid.engine.config import SchedulerConfig
from superfluid.engine.outputs import Outbox
from superfluid.engine.params import GrammarSpec

PLAIN = SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(runtime="toy")


def top_k_1(output_ids, logits):
    keep = int(np.argmax(logits))
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


def identity(output_ids, logits):
    return logits


def texts(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_top_k_1_processor_gives_the_greedy_text(llm):
    greedy = llm.generate(["the river runs"], PLAIN.with_(temperature=0))
    hot = llm.generate(["the river runs"], PLAIN.with_(temperature=1.5, logits_processors=[top_k_1]))
    assert texts(hot) == texts(greedy)
    assert hot[0].outputs[0].text == greedy[0].outputs[0].text
    # and without the processor the hot draw is another text: the processor did that
    assert texts(llm.generate(["the river runs"], PLAIN.with_(temperature=1.5))) != texts(greedy)


def test_an_unchanging_processor_gives_the_engine_sampled_text_with_seed_n_and_logprobs(llm):
    p = PLAIN.with_(n=3, logprobs=3, presence_penalty=0.7, repetition_penalty=1.3, logit_bias={40: 3.0})
    ref = llm.generate(["seeded and penalised"], p)[0]
    host = llm.generate(["seeded and penalised"], p.with_(logits_processors=[identity]))[0]
    assert [c.token_ids for c in host.outputs] == [c.token_ids for c in ref.outputs]
    assert len({tuple(c.token_ids) for c in host.outputs}) == 3  # n=3: three samples
    for a, b in zip(host.outputs, ref.outputs):
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        for ea, eb in zip(a.logprobs, b.logprobs):
            for tok in ea:
                assert ea[tok].logprob == pytest.approx(eb[tok].logprob, abs=1e-5)
                assert ea[tok].rank == eb[tok].rank


def test_both_processor_forms_see_the_right_ids_and_a_batch_mixes_host_and_engine_lanes(llm):
    seen = []

    def with_prompt(prompt_ids, output_ids, logits):
        seen.append((list(prompt_ids), list(output_ids)))
        return logits

    prompts = ["alpha", "beta gamma"]
    params = [PLAIN.with_(logits_processors=[with_prompt]), PLAIN.with_(seed=5)]
    outs = llm.generate(prompts, params)
    ref = llm.generate(prompts, [PLAIN, PLAIN.with_(seed=5)])
    assert texts(outs) == texts(ref)
    prompt_ids = llm.get_tokenizer().encode("alpha")
    assert seen[0] == (prompt_ids, [])
    assert [o for _, o in seen] == [outs[0].outputs[0].token_ids[:i] for i in range(24)]


def test_a_sampler_returning_a_fixed_sequence_is_obeyed(llm):
    seq = [30, 31, 32, 33, 34, 30, 31, 32]
    out = llm.generate(["anything"], SamplingParams(max_tokens=8, sampler=lambda ids, logits: seq[len(ids)]))[0]
    assert out.outputs[0].token_ids == seq
    assert out.outputs[0].text == llm.get_tokenizer().decode(seq)
    assert out.outputs[0].finish_reason == "length"


def test_a_sampler_ends_on_eos_and_stop_strings_cut_host_text(llm):
    tok = llm.get_tokenizer()
    eos = tok.eos_ids[0]
    out = llm.generate(["x"], SamplingParams(max_tokens=8, sampler=lambda ids, l: [40, 41, eos, 42][len(ids)]))[0]
    assert out.outputs[0].token_ids == [40, 41, eos] and out.outputs[0].finish_reason == "stop"
    words = tok.encode("one two three four")
    out = llm.generate(["x"], SamplingParams(max_tokens=20, stop=["three"],
                                             sampler=lambda ids, l: (words + [eos])[len(ids)]))[0]
    assert out.outputs[0].text == "one two " and out.outputs[0].stop_reason == "three"


def test_a_raising_callback_fails_only_its_request(llm):
    def boom(ids, logits):
        if len(ids) == 3:
            raise ValueError("no more")
        return logits

    ref = llm.generate(["keep going", "me too"], [PLAIN, PLAIN.with_(logits_processors=[identity])])
    outs = llm.generate(
        ["fails", "keep going", "me too"], [PLAIN.with_(logits_processors=[boom]), PLAIN, PLAIN.with_(logits_processors=[identity])]
    )
    bad = outs[0].outputs[0]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 3
    assert "logits processor 0 (test_a_raising_callback_fails_only_its_request.<locals>.boom)" in bad.error
    assert "ValueError: no more" in bad.error
    assert texts(outs[1:]) == texts(ref)
    # the engine goes on: the next call is served as usual
    assert texts(llm.generate(["keep going"], PLAIN)) == texts(ref[:1])


@pytest.mark.parametrize(
    "params,message",
    [
        (SamplingParams(max_tokens=4, sampler=lambda ids, l: 10_000), "outside the vocabulary"),
        (SamplingParams(max_tokens=4, sampler=lambda ids, l: "a"), "not a token id"),
        (SamplingParams(max_tokens=4, logits_processors=[lambda ids, l: l[:5]]), "shape (5,)"),
        (SamplingParams(max_tokens=4, logits_processors=[lambda ids, l: np.full_like(l, -np.inf)]), "-inf"),
    ],
)
def test_a_bad_token_or_row_fails_its_request_clearly(llm, params, message):
    outs = llm.generate(["bad", "good"], [params, PLAIN])
    assert outs[0].outputs[0].finish_reason == "error" and message in outs[0].outputs[0].error
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 24


def test_a_grammar_masks_first_then_the_processor_runs(llm):
    g = GrammarSpec("regex", "[a-d]{3,12}")
    p = SamplingParams(temperature=0.9, seed=2, max_tokens=20, grammar=g)
    ref = llm.generate(["letters"], p)[0].outputs[0]
    rows = []

    def look(ids, logits):
        rows.append(np.isfinite(logits).sum())
        return logits

    host = llm.generate(["letters"], p.with_(logits_processors=[look]))[0].outputs[0]
    assert host.token_ids == ref.token_ids and host.finish_reason == ref.finish_reason
    assert all(0 < n < 20 for n in rows[:3])  # the processor saw the grammar's mask
    assert set(host.text) <= set("abcd") and 3 <= len(host.text) <= 12
    # a sampler that picks a token the grammar masked fails its request
    bad = llm.generate(["letters"], p.with_(sampler=lambda ids, l: int(np.argmin(l))))[0].outputs[0]
    assert bad.finish_reason == "error" and "grammar" in bad.error


def test_a_slow_callback_holds_back_only_its_own_lane():
    llm = LLM(runtime="toy", runtime_args={"step_delay": 0.002})
    stamps: dict[str, list[float]] = {"slow": [], "fast": []}
    slow_window = []

    def slow(ids, logits):
        if len(ids) == 2:
            start = time.monotonic()
            time.sleep(0.6)
            slow_window.append((start, time.monotonic()))
        stamps["slow"].append(time.monotonic())
        return logits

    def fast(ids, logits):
        stamps["fast"].append(time.monotonic())
        return logits

    plain_times = []
    class Timed(Outbox):  # LLM reads the deltas back; the times are taken as they come
        def __call__(self, d):
            if d.request_id.endswith("2") and d.token_ids:
                plain_times.append(time.monotonic())
            super().__call__(d)

    llm.engine.stream_to(Timed())
    outs = llm.generate(["slow one", "fast one", "plain one"], [
        PLAIN.with_(max_tokens=8, logits_processors=[slow]),
        PLAIN.with_(max_tokens=40, logits_processors=[fast]),
        PLAIN.with_(max_tokens=40),
    ])
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 40, 40]
    (start, end), = slow_window
    during = [t for t in stamps["fast"] if start < t < end]
    plain_during = [t for t in plain_times if start < t < end]
    assert len(during) >= 10 and len(plain_during) >= 10, (len(during), len(plain_during))
    ref = LLM(runtime="toy").generate(["slow one"], PLAIN.with_(max_tokens=8))
    assert texts(outs[:1]) == texts(ref)


def test_preempted_host_lane_replays_accepted_tokens_without_calling_again():
    """A better-priority request takes the only lane; the host lane is preempted and
    re-admitted with decode_replay: the same text, and each accepted token's position
    went through the processor once (only a row that was out may be seen twice)."""
    llm = LLM(runtime="toy", scheduler=SchedulerConfig(max_running=1))
    eng = llm.engine
    calls = Counter()

    def count(ids, logits):
        calls[len(ids)] += 1
        return logits

    low = PLAIN.with_(max_tokens=30, priority=5, logits_processors=[count])
    ref = llm.generate(["low one"], low.with_(logits_processors=[identity]))[0].outputs[0].token_ids
    eng.stream_to(None)
    got = {}
    eng.add_request("low", llm.tokenizer.encode("low one"), low)
    for _ in range(8):
        eng.step()
        for d in eng.output.take():
            got.setdefault(d.request_id, []).extend(d.token_ids)
    eng.add_request("high", llm.tokenizer.encode("high one"), PLAIN.with_(max_tokens=5, priority=0))
    order = []
    while eng.has_work():
        eng.step()
        for d in eng.output.take():
            got.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason:
                order.append(d.request_id)
    assert order == ["high", "low"]
    assert eng.scheduler.stats.preemptions == 1
    assert got["low"] == ref
    assert sorted(calls) == list(range(30))
    assert sum(calls.values()) - 30 <= 1


def test_worker_crash_replays_committed_tokens_and_calls_again_only_for_the_row_out():
    """LLM(worker=True): the worker is SIGKILLed from inside a processor (at position 6,
    which then waits while an engine-sampled lane keeps ticking, so the loss is seen with
    its row still out). Both requests end with their texts; positions before 6 were not
    called again (decode-replayed), 6 was (its row was computed anew)."""
    ref_llm = LLM(runtime="toy")
    p = PLAIN.with_(max_tokens=20)
    ref = texts(ref_llm.generate(["crash me", "beside it"], [p, p.with_(max_tokens=60)]))
    with LLM(runtime="toy", worker=True) as llm:
        calls = Counter()
        killed = threading.Event()

        def killer(ids, logits):
            calls[len(ids)] += 1
            if len(ids) == 6 and not killed.is_set():
                killed.set()
                llm.engine.ex.kill()
                time.sleep(0.3)  # past the engine's grace: the next tick runs without this commit
            return logits

        outs = llm.generate(["crash me", "beside it"], [p.with_(logits_processors=[killer]), p.with_(max_tokens=60)])
        assert killed.is_set() and llm.engine.ex.restart_count == 1
        assert texts(outs) == ref and outs[0].outputs[0].finish_reason == "length"
        assert calls[6] == 2 and all(calls[i] == 1 for i in range(20) if i != 6), calls


def test_plans_commit_with_the_rows_nonce_and_skip_a_lane_whose_row_is_out():
    from test_scheduler import make_engine

    eng, ex = make_engine()
    gate = threading.Event()

    def held(ids, logits):
        if len(ids) == 1:
            gate.wait(5)
        return logits

    tok = eng.tokenizer
    eng.add_request("host", tok.encode("host lane"), PLAIN.with_(max_tokens=4, logits_processors=[held]))
    eng.add_request("plain", tok.encode("plain lane"), PLAIN.with_(max_tokens=30))
    for _ in range(12):
        eng.step()
    (host_tag,) = [r.lane_tag for r in eng.scheduler.table.running.values() if r.params.host_sampled]
    plans = ex.accepted()
    stuck = [p for p in plans[-8:] if any(d.lane_tag == host_tag for d in p.decodes)]
    assert not stuck  # row 1 is out: its lane is not decoded, the plain one is
    assert all(any(d.lane_tag != host_tag for d in p.decodes) for p in plans[-8:])
    gate.set()
    while eng.has_work():
        eng.step()
    commits = [c for p in ex.accepted() for c in p.commits]
    # tokens 1-3 are committed (the executor checked each nonce); the 4th ends the request
    assert [c.lane_tag for c in commits] == [host_tag] * 3
    assert eng.collected["host/0"]["finish"] == "length" and len(eng.collected["host/0"]["ids"]) == 4
    assert len(eng.collected["plain/0"]["ids"]) == 30
