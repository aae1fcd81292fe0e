"""One fatal path (issue 11): every fatal outcome of a tick goes through ``Executor.fatal``
(which, in a worker, exits 70 so that the daemon replaces it and replays), and running
out of sequence slots or cells when a lane's sequence is created is that lane's
OOM_TENTATIVE fault, never a FATAL tick. One test per site, on the toy runtime."""

from __future__ import annotations

import pytest

from superfluid.abi import FaultCode, LaneRetire, Sampling, LaneParams, Status, TickPlan, TickStatus
from superfluid.executor import Executor, ExecutorConfig
from superfluid.runtimes.base import Capacity, Fatal, Fault
from superfluid.runtimes.toy import ToyRuntime

from lane_driver import Driver, LaneRun
from test_executor_equivalence import prompt_of, reference


class Recorded(Executor):
    """An in-process executor that records what ``fatal`` was called for."""

    def __init__(self, rt, **kw):
        super().__init__(rt, config=ExecutorConfig(fatal_exit=False), **kw)
        self.fatal_calls: list[str] = []

    def fatal(self, during: str) -> Status:
        self.fatal_calls.append(during)
        return super().fatal(during)


def cached(rt: ToyRuntime, n: int = 40, out: int = 4) -> tuple[Recorded, Driver, LaneRun]:
    """An executor whose cache holds the published state of one finished lane."""
    ex = Recorded(rt)
    d = Driver(ex)
    first = d.add(LaneRun(1, prompt_of(n), out))
    d.run()
    d.retire([1])
    return ex, d, first


def fatal_tick(ex: Recorded, d: Driver) -> None:
    d.seq += 1
    plan = d.plan()
    assert ex.run_tick(plan).status == Status.FATAL
    assert ex.fatal_calls, "FATAL without Executor.fatal"


def test_seq_create_fatal_at_admit_takes_the_fatal_path():
    rt = ToyRuntime()
    ex, d = Recorded(rt), None
    d = Driver(ex)
    d.add(LaneRun(1, prompt_of(10), 4))
    rt.fail_on("seq_create", Fatal("device lost"))
    d.seq -= 1
    fatal_tick(ex, d)
    assert ex.fatal_calls == ["creating a lane's sequence"]


@pytest.mark.parametrize("error", [Capacity("no sequence slot"), Fault(FaultCode.OOM_TENTATIVE)])
def test_seq_create_out_of_room_faults_only_that_lane(error):
    rt = ToyRuntime()
    ex = Recorded(rt)
    d = Driver(ex)
    a = d.add(LaneRun(1, prompt_of(10), 4))
    b = d.add(LaneRun(2, prompt_of(12, 3), 4))
    rt.fail_on("seq_create", error, after=1)  # the second admit finds no room
    ev = d.tick()
    assert ev.tick_status == TickStatus.LANE_ERRORS and not ex.fatal_calls
    assert [f.lane_tag for f in ev.faults] == [2] and b.fault == FaultCode.OOM_TENTATIVE
    d.lanes.pop(2)
    d.retire([2])  # the scheduler retires the faulted tag, then may re-admit it
    d.run()
    assert a.out == reference(LaneParams(), Sampling.GREEDY, prompt_of(10), n=4)


def test_seq_create_for_a_seeded_lane_out_of_room_faults_and_unpins():
    rt = ToyRuntime()
    ex, d, _ = cached(rt)
    lease = d.lease(prompt_of(40) + [5, 6])
    run = d.add(LaneRun(2, prompt_of(40) + [5, 6], 4, lease_handle=lease.handle))
    rt.fail_on("seq_create", Capacity("full"))
    ev = d.tick()
    assert run.fault == FaultCode.OOM_TENTATIVE and not ex.fatal_calls
    assert all(e.pins == 0 for e in ex.cache.entries)  # the fault left nothing pinned
    assert ev.tick_status == TickStatus.LANE_ERRORS


def test_seq_create_fatal_for_a_seeded_lane_takes_the_fatal_path():
    rt = ToyRuntime()
    ex, d, _ = cached(rt)
    lease = d.lease(prompt_of(40) + [5, 6])
    d.add(LaneRun(2, prompt_of(40) + [5, 6], 4, lease_handle=lease.handle))
    rt.fail_on("seq_create", Fatal("device lost"))
    d.seq -= 1
    fatal_tick(ex, d)
    assert ex.fatal_calls == ["creating a leased lane's sequence"]


def test_take_over_truncate_failure_takes_the_fatal_path():
    rt = ToyRuntime(takeover_preferred=True)
    ex, d, first = cached(rt, 45, 7)
    turn = prompt_of(45) + [9, 10, 11]  # its whole prompt but not the answer: the entry is cut on take-over
    lease = d.lease(turn)
    [entry] = ex.cache.entries
    assert 0 < lease.prefix_len < len(entry.tokens)
    d.add(LaneRun(2, turn, 4, lease_handle=lease.handle))
    rt.fail_on("seq_truncate", Fatal("device lost"))
    d.seq -= 1
    fatal_tick(ex, d)
    assert ex.fatal_calls == ["a take-over's truncate"]


def test_adopted_sequence_truncate_failure_takes_the_fatal_path():
    src = Executor(ToyRuntime())
    ds = Driver(src)
    ds.add(LaneRun(1, prompt_of(30), 2))
    ds.run()
    ds.retire([1])
    [entry] = src.cache.entries
    payload = src.prim.seq_export(entry.seq)
    rt = ToyRuntime()
    ex = Recorded(rt)
    lease = ex.adopt(entry.tokens, payload)
    d = Driver(ex)
    d.lease_lens[lease.handle] = lease.prefix_len
    d.add(LaneRun(1, list(entry.tokens), 4, lease_handle=lease.handle))  # the whole prompt: cut one short
    rt.fail_on("seq_truncate", Fatal("device lost"))
    d.seq -= 1
    fatal_tick(ex, d)
    assert ex.fatal_calls == ["an adopted sequence's truncate"]


@pytest.mark.parametrize("failures, site", [
    ({"seq_import": Fault(FaultCode.INTERNAL), "step": Fatal("device lost")}, "prefilling a failed import afresh"),
    ({"seq_import": Fatal("device lost")}, "an import of an exported entry"),  # not prefilled over
])
def test_import_failures_take_the_fatal_path(failures, site):
    rt = ToyRuntime()
    ex, d, _ = cached(rt)
    ex.export_entries()
    lease = d.lease(prompt_of(40))
    d.add(LaneRun(2, prompt_of(40), 6, lease_handle=lease.handle))
    for primitive, error in failures.items():
        rt.fail_on(primitive, error)
    d.seq -= 1
    fatal_tick(ex, d)
    assert ex.fatal_calls == [site]


def test_publishing_a_retired_lane_does_not_swallow_fatal():
    rt = ToyRuntime()
    ex = Recorded(rt)
    d = Driver(ex)
    d.add(LaneRun(1, prompt_of(40), 4))
    d.run()  # the lane's last token waits as its pending input
    rt.fail_on("step", Fatal("device lost"))
    out = ex.run_tick(TickPlan(d.seq + 1, retires=[LaneRetire(1, True)]))
    assert out.status == Status.FATAL and ex.fatal_calls == ["publishing a retired lane's last token"]


def test_publishing_a_retired_lane_survives_a_fault():
    rt = ToyRuntime()
    ex = Recorded(rt)
    d = Driver(ex)
    d.add(LaneRun(1, prompt_of(40), 4))
    d.run()
    rt.fail_on("step", Fault(FaultCode.INTERNAL))
    out = ex.run_tick(TickPlan(d.seq + 1, retires=[LaneRetire(1, True)]))
    assert out.status == Status.OK and not ex.fatal_calls and ex.cache.entries  # published without its last token
