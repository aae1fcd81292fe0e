"""A request's lifecycle (issue 24): one phase per request, moved only by the
``RequestTable``, only along the moves lifecycle.py allows; every token reaches a
request through one door (the Finisher), which decides where it ends."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

from superfluid.engine import request_table
from superfluid.engine.config import SchedulerConfig
from superfluid.engine.finisher import Finisher
from superfluid.engine.lifecycle import ALLOWED, LIVE, QUEUED, RETIRES, LifecycleError, Phase, check
from superfluid.engine.params import SamplingParams
from superfluid.engine.priority import PriorityPolicy
from superfluid.engine.request import FinishReason, Request
from superfluid.engine.request_table import Ended, Queued, RequestTable, Settled
from superfluid.engine.token_events import Source, TokenEvent
from superfluid.engine.updates import SchedulerStats
from superfluid.runtimes.base import RuntimeDesc
from test_handles import ACTIONS, make_engine, play, settle

ROOT = Path(__file__).resolve().parent.parent / "superfluid"


def test_every_phase_is_reachable_and_finished_is_the_end():
    seen, todo = {Phase.WAITING}, [Phase.WAITING]
    while todo:
        for nxt in ALLOWED[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(Phase)
    assert ALLOWED[Phase.FINISHED] == frozenset()
    with pytest.raises(LifecycleError):
        check(Phase.FINISHED, Phase.WAITING)
    with pytest.raises(LifecycleError):
        check(Phase.DECODING, Phase.PREFILLING)  # a lane never un-prefills


def test_only_the_request_table_moves_a_phase():
    """No module but request_table.py assigns ``.phase`` (a Request's default aside)."""
    writers = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
            if any(isinstance(t, ast.Attribute) and t.attr == "phase" for t in targets):
                writers.append(path.name)
    assert set(writers) == {"request_table.py"}


def _table():
    desc = RuntimeDesc("fake", vocab_size=100, max_batch=4, max_seq_len=64)
    return RequestTable(SchedulerConfig(), desc, PriorityPolicy(), SchedulerStats())


def _req(rid="r", max_new=5, **kw) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(temperature=0, **kw), max_new_tokens=max_new)


def test_the_finisher_decides_in_order_and_the_first_verdict_wins():
    table = _table()
    fin = Finisher(table, eos_ids=frozenset({9}))
    stopped_at = {}
    fin.text = lambda req, token, lp: stopped_at.get(req.request_id) == token

    def run(req, *events):
        table.apply(Queued(req))
        for ev in events:
            fin.take(ev)
        return req

    # a stop token id ends it at once: later tokens never happen
    a = _req("a", stop_token_ids=(4,))
    run(a, TokenEvent(a, 5), TokenEvent(a, 4), TokenEvent(a, 6))
    assert a.output_token_ids == [5, 4] and a.phase is Phase.ENDING and a.finish_reason is FinishReason.STOP
    # max_tokens: LENGTH on the last token, even when a stop string also completes there
    b = _req("b", max_new=2)
    stopped_at["b"] = 7
    run(b, TokenEvent(b, 6), TokenEvent(b, 7), TokenEvent(b, 8))
    assert b.output_token_ids == [6, 7] and b.finish_reason is FinishReason.LENGTH
    # an EOS the host picked ends it; one the lane picked is the lane's to report
    c, d = _req("c"), _req("d")
    run(c, TokenEvent(c, 9, source=Source.HOST))
    run(d, TokenEvent(d, 9))
    assert c.finish_reason is FinishReason.STOP and d.takes_tokens
    fin.take(TokenEvent(d, finish=FinishReason.STOP))
    assert d.phase is Phase.ENDING and d.output_token_ids == [9]
    # a stop string the text completed
    e = _req("e")
    stopped_at["e"] = 3
    run(e, TokenEvent(e, 2), TokenEvent(e, 3), TokenEvent(e, 4))
    assert e.output_token_ids == [2, 3] and e.finish_reason is FinishReason.STOP
    # nothing is released until the end settles; then each goes once, in the order they ended
    assert not any(r.is_finished for r in (a, b, c, d, e))
    assert table.apply(Settled()) == [a, b, c, d, e]
    assert all(r.phase is Phase.FINISHED for r in (a, b, c, d, e))
    assert table.apply(Settled()) == []
    table.apply(Ended(a, FinishReason.ABORT))  # a later verdict changes nothing
    assert a.finish_reason is FinishReason.STOP and a.phase is Phase.FINISHED


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(actions=ACTIONS)
def test_every_move_is_allowed_and_the_table_stays_consistent(actions):
    """Random submissions, steps, aborts, handovers and lane faults on a small pool: each
    move the table makes is one lifecycle.py allows, the table's indexes agree with the
    phases after every action, nothing is left ENDING between steps, and everything ends
    FINISHED."""
    moves: list[tuple[Phase, Phase]] = []
    real = request_table.check

    def recorded(old, new):
        moves.append((old, new))
        real(old, new)

    request_table.check = recorded
    try:
        eng, ex = make_engine(n_cells=160, page=4)
        reqs = play(eng, ex, actions, after=lambda eng, ex, reqs: _consistent(eng.scheduler.table, reqs))
        settle(eng, ex, reqs)
    finally:
        request_table.check = real
    assert all(new in ALLOWED[old] or new is old for old, new in moves)
    assert all(r.phase is Phase.FINISHED for r in reqs)


def _consistent(table: RequestTable, reqs: list[Request]) -> None:
    assert table.ending == []  # every end settled before the engine returned
    assert {id(r) for r in table.waiting} == {id(r) for r in reqs if r.phase in QUEUED}
    for tag, req in table.running.items():
        assert req.lane_tag == tag and req.phase in LIVE | RETIRES
    for req in reqs:
        if req.phase in LIVE:
            assert table.running.get(req.lane_tag) is req
        if req.phase is Phase.FINISHED:
            assert req.lane_tag is None
