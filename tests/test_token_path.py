"""One token path (issue 10, part 3): a tick's tokens reach the scheduler once -- as
partial emits (logprobs included) when the engine streams, else in the events -- and
requests finish only between ticks, so no operation runs while the executor is busy.
"""

from __future__ import annotations

from superfluid import abi
from superfluid.engine.config import EngineConfig, SchedulerConfig
from superfluid.engine.engine import Engine
from superfluid.engine.params import GrammarSpec, SamplingParams
from superfluid.executor import Executor
from superfluid.rings import Rings
from superfluid.runtimes.toy import ToyRuntime


class Watched:
    """An executor that records every operation called while one of its ticks runs,
    and every partial emit it sends."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.ticking = False
        self.during_tick: list[str] = []
        self.partials: list[abi.PartialEmit] = []

    def __getattr__(self, name):
        attr = getattr(self.ex, name)
        if not callable(attr):
            return attr

        def call(*a, **kw):
            if self.ticking:
                self.during_tick.append(name)
            return attr(*a, **kw)

        return call

    def run_tick(self, plan, on_partial_emit=None):
        def tap(e):
            self.partials.append(e)
            on_partial_emit(e)

        self.ticking = True
        try:
            return self.ex.run_tick(plan, tap if on_partial_emit is not None else None)
        finally:
            self.ticking = False


def _engine(streams: bool, rounds: int = 8):
    rt = ToyRuntime()
    rings = Rings(rt.desc.vocab_size)
    ex = Watched(Executor(rt, rings))
    eng = Engine(ex, rings, rt.tokenizer, EngineConfig(runtime="toy", scheduler=SchedulerConfig(max_rounds=rounds)))
    deltas = []
    if streams:
        eng.stream_to(deltas.append)
    return eng, ex, deltas


def _drive(eng, deltas=None):
    out = []
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
        if deltas is None:
            out += eng.output.take()
    assert not eng.has_work()
    return deltas if deltas is not None else out


def _texts(deltas) -> dict:
    got: dict = {}
    for d in deltas:
        o = got.setdefault((d.request_id, d.index), {"ids": [], "lps": [], "finish": None})
        o["ids"] += d.token_ids
        o["lps"] += list(d.logprobs or [])
        if d.finish_reason:
            o["finish"] = d.finish_reason
    return got


def _requests(eng):
    """Requests that end mid-tick in every way: a stop string, max_tokens, a grammar's
    end; with handles (a logit bias, a grammar) to release and logprobs to carry."""
    ids = eng.tokenizer.encode("the path of one token " * 4)
    eng.add_request("stopped", ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=["e"],
                                                   logit_bias={5: 2.0}))
    eng.add_request("short", ids, SamplingParams(temperature=0.8, seed=3, max_tokens=3, ignore_eos=True, logprobs=2))
    eng.add_request("long", ids, SamplingParams(temperature=0.8, seed=4, max_tokens=30, ignore_eos=True, logprobs=1))
    eng.add_request("grammar", ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                   grammar=GrammarSpec("regex", "[a-d]{6}")))


def test_requests_that_end_mid_tick_finish_after_it():
    eng, ex, deltas = _engine(streams=True)
    _requests(eng)
    _drive(eng, deltas)
    # Ending requests (a stop string, max_tokens) released their handles and lanes
    # after the tick: no operation ran while a tick was running.
    assert ex.during_tick == []
    got = _texts(deltas)
    assert {k[0] for k in got} == {"stopped", "short", "long", "grammar"}
    assert all(o["finish"] for o in got.values())
    assert len(got[("short", 0)]["ids"]) == 3 and len(got[("long", 0)]["ids"]) == 30


def test_streamed_and_event_paths_give_the_same_tokens_and_logprobs():
    streamed_eng, ex, deltas = _engine(streams=True)
    _requests(streamed_eng)
    streamed = _texts(_drive(streamed_eng, deltas))
    plain_eng, plain_ex, _ = _engine(streams=False)
    _requests(plain_eng)
    plain = _texts(_drive(plain_eng))
    assert streamed == plain
    # the streamed run took its tokens from partial emits, logprobs and all
    assert ex.partials and not plain_ex.partials
    assert any(e.logprob is not None for e in ex.partials)
    assert len(streamed[("long", 0)]["lps"]) == 30


def test_a_stream_sees_tokens_before_its_tick_ends():
    """Partial emits reach the engine's deltas while the tick still runs (the point of them)."""
    eng, ex, deltas = _engine(streams=True, rounds=16)
    ids = eng.tokenizer.encode("stream me " * 4)
    seen_in_tick = []
    eng.stream_to(lambda d: (deltas.append(d), seen_in_tick.append(ex.ticking)))
    eng.add_request("a", ids, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0))
    _drive(eng, deltas)
    token_deltas = [t for d, t in zip(deltas, seen_in_tick) if d.token_ids]
    assert token_deltas and all(token_deltas)
