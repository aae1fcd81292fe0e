"""One request whose step raises fails alone: the engine blames the new request the failed
plan was built over (probation sorts out several), and every other request goes on to the
text it would have had without it."""

from __future__ import annotations

import pytest

from superfluid.engine.params import SamplingParams

from test_scheduler import make_engine, prompt, run

INNOCENT = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=30, ignore_eos=True)
POISON_TOP_P = 0.123  # the request whose lane parameters raise (a stand-in for any bug a value can reach)


@pytest.fixture
def poisoned(monkeypatch):
    real = SamplingParams.abi_params

    def abi_params(self, *a, **kw):
        if self.top_p == POISON_TOP_P:
            raise OverflowError("int too big to convert")
        return real(self, *a, **kw)

    monkeypatch.setattr(SamplingParams, "abi_params", abi_params)


def reference(texts: list[str]) -> dict[str, dict]:
    eng, _ = make_engine()
    for i, t in enumerate(texts):
        eng.add_request(f"r{i}", prompt(eng, t), INNOCENT.with_(seed=i))
    return run(eng)


TEXTS = ["the first prompt", "a second one", "and a third"]


def test_a_poisoned_request_fails_alone_while_others_run(poisoned):
    want = reference(TEXTS)
    eng, _ = make_engine()
    for i, t in enumerate(TEXTS):
        eng.add_request(f"r{i}", prompt(eng, t), INNOCENT.with_(seed=i))
    for _ in range(3):  # the innocents are running
        eng.step()
    eng.add_request("poison", prompt(eng, "poison"), INNOCENT.with_(top_p=POISON_TOP_P))
    got = run(eng)
    assert got["poison/0"]["finish"] == "error" and "could not be run" in got["poison/0"]["error"]
    for i in range(len(TEXTS)):
        assert got[f"r{i}/0"] == want[f"r{i}/0"]


def test_new_suspects_go_on_probation_and_only_the_poisoned_one_fails(poisoned):
    want = reference(TEXTS)
    eng, _ = make_engine()
    eng.add_request("poison", prompt(eng, "poison"), INNOCENT.with_(top_p=POISON_TOP_P))
    for i, t in enumerate(TEXTS):  # all new together: four suspects for the first failure
        eng.add_request(f"r{i}", prompt(eng, t), INNOCENT.with_(seed=i))
    got = run(eng)
    assert got["poison/0"]["finish"] == "error"
    for i in range(len(TEXTS)):
        assert got[f"r{i}/0"] == want[f"r{i}/0"]


def test_a_submission_that_fails_part_way_leaves_nothing_queued(monkeypatch):
    eng, _ = make_engine()
    real = eng.scheduler.add
    calls = []

    def add(req, fresh=False):
        calls.append(req)
        if len(calls) == 2:
            raise OverflowError("the second choice cannot be placed")
        real(req, fresh)

    monkeypatch.setattr(eng.scheduler, "add", add)
    with pytest.raises(OverflowError):
        eng.add_request("bad", prompt(eng, "x"), INNOCENT.with_(n=3))
    assert eng.scheduler.num_waiting == 0 and not eng.has_work() and "bad" not in eng._groups
