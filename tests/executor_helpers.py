"""Shared helpers for the executor's reject and property tests: a thin driver over
``Executor.run_tick`` and the invariants every OK tick must keep."""

from __future__ import annotations

from collections import Counter

from superfluid.abi import ShedKind, Status, TickOutcome, TickPlan
from superfluid.executor import Executor
from superfluid.runtimes.toy import ToyRuntime


def state(ex: Executor) -> tuple:
    """Everything a rejected plan must leave as it was: the executor's and the runtime's."""
    return ex.snapshot(), ex.prim.snapshot()


class Driver:
    """An executor over a toy runtime, with plan numbering and prompt writing."""

    def __init__(self, rt: ToyRuntime | None = None, **rt_kwargs):
        self.rt = rt if rt is not None else ToyRuntime(**rt_kwargs)
        self.ex = Executor(self.rt)
        self.rings = self.ex.rings

    @property
    def next_seq(self) -> int:
        last = self.ex.last_plan_seq
        return 1 if last is None else last + 1

    def begin(self) -> None:
        self.rings.begin_prompts()

    def write(self, tokens):
        return self.rings.write_prompt(list(tokens))

    def plan(self, **kw) -> TickPlan:
        kw.setdefault("plan_seq", self.next_seq)
        return TickPlan(**kw)

    def tick(self, **kw) -> TickOutcome:
        return self.ex.run_tick(self.plan(**kw))

    def ok(self, **kw) -> TickOutcome:
        out = self.tick(**kw)
        assert out.status == Status.OK, Status(out.status).name
        check_invariants(self.ex)
        return out

    def emitted(self, out: TickOutcome, tag: int) -> list[int]:
        for e in out.events.emits:
            if e.lane_tag == tag:
                return self.rings.read_emits(e.token_ref)
        raise KeyError(tag)

    def emit(self, out: TickOutcome, tag: int):
        for e in out.events.emits:
            if e.lane_tag == tag:
                return e
        raise KeyError(tag)


def check_invariants(ex: Executor) -> None:
    """Memory and bookkeeping invariants that hold between ticks."""
    rt = ex.prim
    # cells the runtime counts are exactly the cells its live sequences hold
    assert rt.mem_counters().cells_used == rt.cells_of_live_seqs()
    # every live runtime sequence belongs to exactly one lane, resident entry or bare seq
    owners = [l.seq for l in ex.lanes.values()] + [e.seq for e in ex.cache.resident()] + list(ex.bare)
    dup = [s for s, n in Counter(owners).items() if n > 1]
    assert not dup, f"sequences owned twice: {dup}"
    assert set(rt.seqs) == set(owners), (
        f"leaked {set(rt.seqs) - set(owners)}, dangling {set(owners) - set(rt.seqs)}"
    )
    # a resident entry's sequence holds at least its key
    for e in ex.cache.resident():
        assert rt.seq_len(e.seq) >= len(e.tokens)
    # pins count the live leases naming each entry
    leases = Counter(s.entry_id for s in ex.leases.values() if s.adopted is None and s.entry_id)
    for e in ex.cache:
        assert e.pins >= 0
        assert e.pins == leases.get(e.entry_id, 0), (e.entry_id, e.pins, leases.get(e.entry_id, 0))
    ids = {e.entry_id for e in ex.cache}
    assert set(leases) <= ids, f"leases name entries that are gone: {set(leases) - ids}"
    # adopted leases hold bare sequences
    for s in ex.leases.values():
        if s.adopted is not None:
            assert s.adopted in ex.bare
    # no lane is both live and awaiting its retire after a fault
    assert not (set(ex.lanes) & ex.faulted)


def cache_view(ex: Executor) -> dict[int, tuple[bool, int]]:
    """entry id -> (resident, bytes)."""
    return {e.entry_id: (e.seq is not None, e.bytes) for e in ex.cache}


def check_cache_reconciles(before: dict[int, tuple[bool, int]], ex: Executor, out: TickOutcome) -> None:
    """Resident bytes before - CACHE_EVICTION shed bytes + bytes published == resident
    bytes after. Published: entries that did not exist before the tick (a retire's
    publish or a checkpoint), whether they are still resident or already left the pool
    (an entry that leaves the pool is exported or dropped; either way it was shed)."""
    after = cache_view(ex)
    res_before = sum(b for r, b in before.values() if r)
    res_after = sum(b for r, b in after.values() if r)
    published = sum(b for i, (r, b) in after.items() if i not in before)
    shed = [s for s in out.events.shed.entries if s.kind == ShedKind.CACHE_EVICTION]
    shed_bytes = sum(s.bytes for s in shed)
    assert out.events.shed.bytes_evicted == shed_bytes
    assert out.events.shed.evictions_performed == len(shed)
    assert res_before - shed_bytes + published == res_after, (res_before, shed_bytes, published, res_after)
    assert out.events.mem.pool_bytes_evictable == ex.cache.unpinned_bytes()
    assert out.events.mem.host_retained_bytes == ex.cache.exported_bytes()
