"""One tick: validate and check capacity (no change), then carry the plan out.

Carry-out order: leave-pool for the capacity check's victims; retires (publish or
free) and cache settling; commits; take-overs; admits; prefill steps; decode-replay
passes; decode rounds; the spec gate's record; emits; events.
"""

from __future__ import annotations

import time
from ..abi import PartialEmitCallback, Status, TickEvents, TickMemCounters, TickOutcome, TickPlan, TickStatus, TickTimings, ShedReport
from ..runtimes.base import Fatal
from .admit import admit, take_over
from .capacity import Fit, check_capacity
from .context import TickContext
from .decode import decode_phase
from .faults import FatalTick
from .prefill import prefill_phase
from .retire import commit, retire
from .tick_state import TickState
from .validate import Reject, validate


def run_tick(c: TickContext, plan: TickPlan, on_partial_emit: PartialEmitCallback | None) -> TickOutcome:
    t_start = time.perf_counter_ns()
    try:
        chk = validate(c, plan)
        fit = check_capacity(c, plan, chk)
    except Reject as r:
        return TickOutcome(int(r.status))
    # ---- from here on the plan is carried out
    c.last_plan_seq = plan.plan_seq
    c.pool.protected_quota = plan.protected_quota_bytes
    c.tick_count += 1
    c.rings.begin_output()
    st = TickState(plan, chk, on_partial_emit)
    try:
        _carry_out(c, st, fit)
    except FatalTick as f:
        return TickOutcome(int(f.status))
    except Fatal as e:  # one no site caught (e.g. an eviction's export): still the one fatal path
        return TickOutcome(int(c.fatal(f"the tick's carry-out ({e})")))
    return TickOutcome(int(Status.OK), _events(c, st, t_start))


def _carry_out(c: TickContext, st: TickState, fit: Fit) -> None:
    evicted: list[tuple[int, int]] = []
    for e in fit.victims:
        c.pool.leave(e, evicted)
    retire(c, st)
    c.pool.settle(evicted)
    # Every eviction, the capacity check's and the cache's own, is a shed entry,
    # so the report reconciles with the memory counters.
    for nbytes, tokens in evicted:
        st.evicted(0, nbytes, tokens)
    for cm in st.plan.commits:
        commit(c, st, cm)
    taken = take_over(c, st, fit.taken_over)
    for a in st.plan.admits:
        admit(c, st, a, taken)
    c.leases.sweep(c.tick_count)
    prefill_phase(c, st)
    decode_phase(c, st)


def _events(c: TickContext, st: TickState, t_start: int) -> TickEvents:
    if st.faults:
        status = TickStatus.LANE_ERRORS
    elif st.chunks_dropped or st.evictions:
        status = TickStatus.SHED
    else:
        status = TickStatus.OK
    mem = c.prim.mem_counters()
    page = c.pool.page
    completions, c.done_ops = c.done_ops, []
    return TickEvents(
        plan_seq=st.plan.plan_seq,
        tick_status=int(status),
        admit_results=st.admit_results,
        emits=st.emits,
        faults=st.faults,
        shed=ShedReport(st.chunks_dropped, st.evictions, st.bytes_evicted, st.shed),
        op_completions=completions,
        timings=TickTimings(time.perf_counter_ns() - t_start, st.prefill_ns, st.decode_ns),
        mem=TickMemCounters(
            allocated_bytes=mem.allocated_bytes,
            host_retained_bytes=c.pool.cache.exported_bytes(),
            pool_blocks_total=mem.cells_total // page,
            pool_blocks_used=mem.cells_used // page,
            pool_bytes_evictable=c.pool.cache.unpinned_bytes(c.pool.protected()),
            tentative_bytes=0,
            cache_classes=c.pool.classes(),
        ),
        logprobs=st.logprobs,
        prompt_logprobs=st.prompt_logprobs,
    )
