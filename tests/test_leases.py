"""Leases (issue 11): the scheduler leases a cached prefix before it knows whether the request
is admitted; a lease it did not use goes back at the end of the step, so after every step
the only pinned cache entries are those a live lease holds, and a pool full of entries that
waiting requests leased still admits."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid.engine.config import SchedulerConfig
from superfluid.engine.params import SamplingParams

from test_scheduler import make_engine, prompt, run

SYSTEM = "You are a helpful assistant of the river harbour office. " * 3


def pinned_without_lease(ex) -> list[int]:
    held: dict[int, int] = {}
    for lease in ex.leases.values():
        if lease.entry_id:
            held[lease.entry_id] = held.get(lease.entry_id, 0) + 1
    return [e.entry_id for e in ex.cache.entries if e.pins != held.get(e.entry_id, 0)]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n_requests=st.integers(4, 12),
    max_running=st.integers(1, 3),
    budget=st.sampled_from([8, 16, 64]),
    lens=st.lists(st.integers(1, 12), min_size=12, max_size=12),
)
def test_after_every_step_only_live_leases_pin(n_requests, max_running, budget, lens):
    eng, ex = make_engine(SchedulerConfig(max_running=max_running, prefill_token_budget=budget))
    eng.add_request("warm", prompt(eng, SYSTEM + "hi"), SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    run(eng)  # the shared prefix is in the cache now
    for i in range(n_requests):
        eng.add_request(f"r{i}", prompt(eng, SYSTEM + f"question {i}"),
                        SamplingParams(temperature=0, max_tokens=lens[i], ignore_eos=True))
    steps = 0
    while eng.has_work():
        eng.step()
        steps += 1
        assert steps < 5000
        assert not pinned_without_lease(ex)
        # every live lease belongs to no one once the step is over: the scheduler keeps none
        assert not [h for h, lease in ex.leases.items() if lease.entry_id], ex.leases
    assert len(eng.collected) == n_requests + 1 and all(o["finish"] for o in eng.collected.values())


def test_a_pool_of_entries_leased_by_waiting_requests_still_admits():
    # a small pool: the cached prefixes fill it; waiting requests lease them while the
    # batch is full, and once the batch frees, they (and newcomers) must still get in
    eng, ex = make_engine(SchedulerConfig(max_running=1, prefill_token_budget=64), n_cells=256, page=4)
    for i in range(6):
        eng.add_request(f"fill{i}", prompt(eng, f"topic {i}: " + "words of filler text " * 3),
                        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    run(eng)
    assert ex.cache.entries
    for i in range(6):
        eng.add_request(f"again{i}", prompt(eng, f"topic {i}: " + "words of filler text " * 3 + "more"),
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    out = run(eng)
    assert all(out[f"again{i}/0"]["finish"] == "length" for i in range(6))
    assert not pinned_without_lease(ex)
