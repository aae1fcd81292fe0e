"""The worker process: the executor across a socket and shared-memory rings, and a
supervisor that replaces a worker that exits 70, dies, or stops making progress."""

import time

import pytest

from superfluid.abi import Sampling, LaneParams, Status
from superfluid.executor.grammar import GrammarError
from superfluid.runtimes.base import Capacity
from superfluid.worker.client import OperationFailed, WorkerClient, WorkerConfig, WorkerFailed, WorkerLost

from lane_driver import Driver, LaneRun
from test_executor_equivalence import SAMPLED, prompt_of, reference


@pytest.fixture
def client():
    c = WorkerClient(WorkerConfig(runtime="toy", stall_timeout=1.5, heartbeat_timeout=2.0, backoff_first=0.05))
    c.start()
    yield c
    c.close()


def test_worker_runs_lanes_like_the_executor_in_process(client):
    d = Driver(client)
    runs = [d.add(LaneRun(i, prompt_of(20 + i, i), 30, sampling=Sampling.SAMPLE, params=SAMPLED, chunk=8, rng_base=77)) for i in (1, 2, 3)]
    d.run()
    for r in runs:
        assert r.out[:30] == reference(SAMPLED, Sampling.SAMPLE, r.prompt, n=30)


def test_partial_emits_cross_the_process_boundary(client):
    d = Driver(client)
    d.add(LaneRun(1, prompt_of(10), 6, rounds=6))
    got = []
    plan = d.plan()
    plan = type(plan)(**{**{f: getattr(plan, f) for f in plan.__struct_fields__}, "flags": 2})
    out = client.run_tick(plan, on_partial_emit=lambda e: got.append(e))
    assert out.status == Status.OK
    assert [e.token for e in got] == client.rings.read_emits(out.events.emits[0].token_ref)


def test_operations_and_errors_cross(client):
    with pytest.raises(GrammarError):
        client.compile_grammar("regex", "[unclosed")
    h = client.compile_grammar("json_object")
    assert h > 0
    client.release_grammar(h)
    with pytest.raises(ValueError):
        client.register_logit_bias({10**9: 1.0})
    with pytest.raises(Capacity):  # the runtime's own PrimError subclass, as in process
        client.adopt([1] * 5000, ["cells", [1] * 5000])


def test_an_attribute_error_inside_an_operation_is_that_operations_internal_error(client):
    # getattr(runtime, "no_such_primitive") fails inside fail_runtime: a bug of the
    # call, not an operation the worker does not know
    with pytest.raises(OperationFailed, match="fail_runtime.*AttributeError") as e:
        client.fail_runtime("no_such_primitive", "fatal")
    assert "unknown operation" not in str(e.value)
    assert client.stats()["lanes"] == 0 and client.state == "ok"  # the worker goes on


def test_fatal_runtime_error_exits_70_and_a_clean_worker_takes_over(client):
    first = client.pid
    d = Driver(client)
    d.add(LaneRun(1, prompt_of(10), 20, rounds=2))
    d.tick()
    client.fail_runtime("step", "fatal")
    with pytest.raises(WorkerLost) as e:
        d.tick()
    assert e.value.exit_code == 70 and client.state == "restarting"
    client.restart()
    assert client.state == "ok" and client.pid != first and client.epoch == 2


def test_a_stuck_worker_is_detected_and_replaced(client):
    d = Driver(client)
    d.add(LaneRun(1, prompt_of(10), 20, rounds=2))
    client.fail_runtime("step", "hang")
    t0 = time.monotonic()
    with pytest.raises(WorkerLost) as e:
        d.tick()
    assert "no progress" in str(e.value) and time.monotonic() - t0 < 10
    client.restart()
    assert client.state == "ok"


@pytest.mark.parametrize("params,sampling", [(LaneParams(), Sampling.GREEDY), (SAMPLED, Sampling.SAMPLE)])
def test_replay_after_sigkill_finishes_with_the_same_tokens(client, params, sampling):
    n = 48
    prompts = [prompt_of(25 + i, i) for i in range(4)]
    want = [reference(params, sampling, p, n=n) for p in prompts]
    d = Driver(client)
    runs = [d.add(LaneRun(i + 1, p, n, sampling=sampling, params=params, rounds=3, rng_base=77)) for i, p in enumerate(prompts)]
    kills = 0
    for tick in range(400):
        if all(r.done for r in runs):
            break
        if tick in (3, 7, 12):
            client.kill()
        try:
            d.tick()
        except WorkerLost:
            kills += 1
            client.restart()
            # every live lane comes back as prompt + generated tokens, decode-replayed,
            # with the same rng_counter_base
            d = Driver(client)
            fresh = []
            for r, p in zip(runs, prompts):
                if not r.done:
                    made = r.prompt[len(p):] + r.out
                    r = LaneRun(r.tag, p + made, n - len(made), sampling=sampling, params=params, rounds=3,
                                decode_replay=len(made), rng_base=77)
                d.add(r)
                fresh.append(r)
            runs = fresh
    assert kills == 3
    for r, p, w in zip(runs, prompts, want):
        assert (r.prompt[len(p):] + r.out)[:n] == w


def test_restarts_are_bounded():
    c = WorkerClient(WorkerConfig(runtime="toy", max_restarts=2, backoff_first=0.01))
    c.start()
    try:
        for _ in range(2):
            c.kill()
            c.restart()
        c.kill()
        with pytest.raises(WorkerFailed):
            c.restart()
        assert c.state == "failed"
    finally:
        c.close()


def test_a_model_that_does_not_load_fails_clearly():
    c = WorkerClient(WorkerConfig(runtime="toy", runtime_args=(("vocab_size", 3),)))
    try:
        with pytest.raises(WorkerFailed, match="toy vocabulary"):
            c.start()
    finally:
        c.close()
