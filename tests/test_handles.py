"""A request's handles (logit bias, grammar) on the toy runtime: every handle acquired
is released exactly once, when its request ends, whatever ends it (a finish, a stop
string, an abort, a lane fault, a server-side failure, a handover) and whatever
happens on the way (preemption, an OOM fault and its retry, a failed submission)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid import abi
from superfluid.engine.config import EngineConfig, SchedulerConfig
from superfluid.engine.engine import Engine
from superfluid.engine.handles import RequestHandles
from superfluid.engine.outputs import ErrorCode
from superfluid.engine.params import GrammarSpec, ParamError, SamplingParams
from superfluid.executor import Executor
from superfluid.rings import Rings
from superfluid.runtimes.toy import ToyRuntime


class HandleLedger:
    """Wraps an executor and counts, per handle, what the engine acquired and released.
    ``fail_compile_at``: the nth compile_grammar call (from 1) fails, as a bad grammar does."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.acquired: dict[tuple[str, int], int] = {}
        self.released: dict[tuple[str, int], int] = {}
        self.compiles = 0
        self.fail_compile_at: int | None = None

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def register_logit_bias(self, bias):
        return self._acquired("bias", self.ex.register_logit_bias(bias))

    def compile_grammar(self, kind, source=None):
        self.compiles += 1
        if self.compiles == self.fail_compile_at:
            raise ValueError("refused (test)")
        return self._acquired("grammar", self.ex.compile_grammar(kind, source))

    def release_logit_bias(self, handle):
        self._released("bias", handle)
        self.ex.release_logit_bias(handle)

    def release_grammar(self, handle):
        self._released("grammar", handle)
        self.ex.release_grammar(handle)

    def _acquired(self, kind: str, handle: int) -> int:
        assert (kind, handle) not in self.acquired, "the executor handed out a live handle twice"
        self.acquired[(kind, handle)] = 1
        return handle

    def _released(self, kind: str, handle: int) -> None:
        assert (kind, handle) in self.acquired, f"released {kind} handle {handle}, never acquired"
        self.released[(kind, handle)] = self.released.get((kind, handle), 0) + 1
        assert self.released[(kind, handle)] == 1, f"{kind} handle {handle} released twice"

    def live(self) -> set[tuple[str, int]]:
        return set(self.acquired) - set(self.released)


def make_engine(**toy) -> tuple[Engine, HandleLedger]:
    rt = ToyRuntime(**toy)
    rings = Rings(rt.desc.vocab_size)
    ex = HandleLedger(Executor(rt, rings))
    # Few rounds per tick and two lanes: requests live for several steps and queue up.
    cfg = SchedulerConfig(max_running=2, max_rounds=2, prefill_token_budget=16, speculative=False)
    return Engine(ex, rings, rt.tokenizer, EngineConfig(runtime="toy", scheduler=cfg)), ex


def held(req) -> set[tuple[str, int]]:
    h = req.handles
    return {k for k in (("bias", h.logit_bias), ("grammar", h.grammar)) if k[1]}


def submit(eng: Engine, reqs: list, *args) -> list:
    """add_request, remembering what each new request acquired (on ``req.took``)."""
    new = eng.add_request(*args)
    for req in new:
        req.took = held(req)
    reqs += new
    return new


def check(eng: Engine, ex: HandleLedger, reqs: list) -> None:
    """A live request still holds every handle it acquired, unreleased; a finished one
    holds none and released all; nothing is held that no live request holds."""
    for req in reqs:
        if req.is_finished:
            assert held(req) == set() and not req.took & ex.live()
        else:
            assert held(req) == req.took and req.took <= ex.live()
    assert ex.live() == set().union(*(r.took for r in reqs if not r.is_finished))


def settle(eng: Engine, ex: HandleLedger, reqs: list) -> None:
    for _ in range(2000):
        if not eng.has_work():
            break
        eng.step()
        check(eng, ex, reqs)
    assert not eng.has_work()
    assert ex.live() == set() and all(n == 1 for n in ex.released.values())


BIAS = {5: 2.0}
GRAMMAR = GrammarSpec("regex", "[a-c]+x")


LONG_GRAMMAR = GrammarSpec("regex", "[a-c]{80}")  # outlasts max_tokens


def params(bias: bool, grammar: bool | GrammarSpec, **kw) -> SamplingParams:
    grammar = GRAMMAR if grammar is True else grammar or None
    return SamplingParams(temperature=0.8, seed=3, max_tokens=kw.pop("max_tokens", 12), ignore_eos=True,
                          logit_bias=BIAS if bias else {}, grammar=grammar, **kw)


def test_finish_and_stop_string_release_once():
    eng, ex = make_engine()
    reqs: list = []
    submit(eng, reqs, "len", eng.tokenizer.encode("abc"), params(True, False, n=2))
    submit(eng, reqs, "grammar", eng.tokenizer.encode("abc"), params(True, True, max_tokens=40))
    submit(eng, reqs, "stop", eng.tokenizer.encode("abc"), params(True, False, stop=("a",), max_tokens=40))
    assert len(ex.acquired) == 5
    settle(eng, ex, reqs)
    assert {r.finish_reason.value for r in reqs} >= {"length", "stop"}


def test_abort_while_waiting_and_while_running_release_once():
    eng, ex = make_engine()
    reqs: list = []
    for i in range(4):
        submit(eng, reqs, f"r{i}", eng.tokenizer.encode("ab"), params(True, True))
    eng.step()
    running = [r for r in reqs if r.lane_tag is not None]
    waiting = [r for r in reqs if r.lane_tag is None]
    assert running and waiting  # max_running=2
    eng.abort(waiting[0].group_id)
    eng.abort(running[0].group_id)
    check(eng, ex, reqs)
    assert held(waiting[0]) == held(running[0]) == set()
    settle(eng, ex, reqs)


@pytest.mark.parametrize("code", [abi.FaultCode.INJECTED, abi.FaultCode.OOM_TENTATIVE])
def test_a_lane_fault_releases_on_error_not_on_retry(code):
    eng, ex = make_engine()
    (req,) = submit(eng, [], "f", eng.tokenizer.encode("abc"), params(True, True, max_tokens=30))
    eng.step()
    before = held(req)
    ex.inject_fault(req.lane_tag, code)
    eng.step()
    if code == abi.FaultCode.OOM_TENTATIVE:  # re-admitted later with the same handles
        assert not req.is_finished and held(req) == before and not ex.released
    else:
        assert req.is_finished and req.finish_reason.value == "error" and held(req) == set()
    settle(eng, ex, [req])


def test_preemption_keeps_handles_and_detach_and_fail_release_them():
    eng, ex = make_engine()
    low: list = []
    for i in range(2):
        submit(eng, low, f"low{i}", eng.tokenizer.encode("ab"), params(True, LONG_GRAMMAR, max_tokens=60, priority=5))
    eng.step()
    eng.step()
    before = {id(r): held(r) for r in low}
    high = submit(eng, [], "high", eng.tokenizer.encode("c"), params(True, False, max_tokens=4))
    eng.step()
    assert eng.scheduler.stats.preemptions >= 1
    assert {id(r): held(r) for r in low} == before and not ex.released  # the victim keeps them
    eng.detach("low0")
    eng.fail("low1", "shutting down", ErrorCode.SHUTTING_DOWN)
    check(eng, ex, low + high)
    settle(eng, ex, low + high)


def test_a_failed_submission_gives_back_what_it_took():
    eng, ex = make_engine()
    ex.fail_compile_at = 2  # the second choice's grammar fails after the first's compiled
    with pytest.raises(ParamError):
        eng.add_request("bad", eng.tokenizer.encode("ab"), params(True, True, n=3))
    assert len(ex.acquired) == 3 and ex.live() == set()  # two biases, one grammar: all back
    assert not eng.has_work()


def test_renew_forgets_the_lost_handles_and_takes_new_ones():
    class Fake:
        def __init__(self):
            self.next, self.released = 0, []

        def register_logit_bias(self, bias):
            self.next += 1
            return self.next

        compile_grammar = lambda self, kind, source=None: self.register_logit_bias({})  # noqa: E731

        def release_logit_bias(self, h):
            self.released.append(("bias", h))

        def release_grammar(self, h):
            self.released.append(("grammar", h))

    fake = Fake()
    h = RequestHandles.acquire(fake, params(True, True))
    assert (h.logit_bias, h.grammar) == (1, 2)
    h.renew()  # the worker was lost: 1 and 2 died with it
    assert (h.logit_bias, h.grammar) == (3, 4) and fake.released == []
    h.release()
    h.release()
    assert fake.released == [("bias", 3), ("grammar", 4)]


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.booleans(), st.booleans(), st.integers(1, 3), st.integers(0, 9)),
        st.tuples(st.just("step"), st.integers(1, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("fault"), st.integers(0, 30), st.sampled_from([abi.FaultCode.INJECTED,
                                                                         abi.FaultCode.OOM_TENTATIVE])),
        st.tuples(st.just("detach"), st.integers(0, 30)),
    ),
    min_size=10,
    max_size=40,
)


def play(eng: Engine, ex: HandleLedger, actions, after=check) -> list:
    """Carry out ``actions`` (from ACTIONS) on the engine, calling ``after(eng, ex, reqs)``
    after each; returns every request submitted."""
    reqs, ids = [], []
    for act in actions:
        kind = act[0]
        if kind == "add":
            _, bias, grammar, n, priority = act
            rid = f"r{len(ids)}"
            submit(eng, reqs, rid, eng.tokenizer.encode("ab " * (3 * priority + 1)),
                   params(bias, grammar and LONG_GRAMMAR, n=n, priority=priority, max_tokens=6 + 3 * priority))
            ids.append(rid)
        elif kind == "step":
            for _ in range(act[1]):
                eng.step()
        elif ids and kind == "abort":
            eng.abort(ids[act[1] % len(ids)])
        elif ids and kind == "detach":
            eng.detach(ids[act[1] % len(ids)])
        elif kind == "fault":
            lanes = [r.lane_tag for r in reqs if r.lane_tag is not None and not r.is_finished]
            if lanes:
                ex.inject_fault(lanes[act[1] % len(lanes)], act[2])
        after(eng, ex, reqs)
    return reqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ACTIONS)
def test_every_handle_is_released_exactly_once(actions):
    # Two lanes and a pool that holds them with little to spare: admissions queue, better
    # priorities preempt, injected OOMs retry. (A pool of 96 cells makes the scheduler
    # give up with SchedulerError on some sequences, before and after handles.py alike.)
    eng, ex = make_engine(n_cells=256, page=4)
    reqs = play(eng, ex, actions)
    settle(eng, ex, reqs)
