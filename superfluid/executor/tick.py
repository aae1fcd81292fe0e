"""One tick: validate and check capacity (no change), then carry the plan out.

Carry-out order: leave-pool for the capacity check's victims; retires (publish or
free) and cache settling; commits; take-overs; admits; prefill steps; decode-replay
passes; decode rounds; the spec gate's record; emits; events.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from ..abi import (
    AdmitResult,
    AdmitStatus,
    Exactness,
    Finish,
    LaneEmit,
    LaneFault,
    LaneLogprob,
    PromptLogprob,
    Sampling,
    ShedEntry,
    ShedKind,
    ShedReport,
    Status,
    TickEvents,
    TickMemCounters,
    TickOutcome,
    TickPlan,
    TickStatus,
    TickTimings,
)
from ..runtimes.base import Capacity, Fatal, Fault, Feed, PrimError
from ..abi import FaultCode
from .capacity import check_capacity
from .grammar_errors import GrammarOverflow
from .lane import Lane
from .speculate import LaneSpec
from .validate import Checked, Reject, validate

if TYPE_CHECKING:
    from .executor import Executor


class FatalTick(Exception):
    """Carry-out hit something it cannot recover from; the tick answers FATAL."""

    def __init__(self, status: Status):
        super().__init__(status.name)
        self.status = status


def lane_fault_code(e: PrimError) -> int | None:
    """A primitive's error as a lane fault code; None means fatal."""
    if isinstance(e, Fault):
        return e.code
    if isinstance(e, Capacity):
        return FaultCode.OOM_TENTATIVE
    if isinstance(e, Fatal):
        return None
    return FaultCode.INTERNAL


@dataclass
class TickState:
    """Everything one tick's carry-out accumulates."""

    plan: TickPlan
    chk: Checked
    on_partial_emit: Callable[[int, int], None] | None
    admit_results: list[AdmitResult] = field(default_factory=list)
    faults: list[LaneFault] = field(default_factory=list)
    faulted: set[int] = field(default_factory=set)
    shed: list[ShedEntry] = field(default_factory=list)
    chunks_dropped: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    logprobs: list[LaneLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    emits: list[LaneEmit] = field(default_factory=list)
    rows: dict = field(default_factory=dict)  # lane -> row waiting to be sampled
    yielded: bool = False  # the prefill stopped early on a yield
    commit_finishes: dict = field(default_factory=dict)  # host lane -> Finish its commit ended it with
    prefill_ns: int = 0
    decode_ns: int = 0

    def evicted(self, lane_tag: int, nbytes: int, tokens: int) -> None:
        self.shed.append(ShedEntry(lane_tag, ShedKind.CACHE_EVICTION, 0, nbytes, tokens))
        self.evictions += 1
        self.bytes_evicted += nbytes

    def dropped(self, lane_tag: int, tokens: int) -> None:
        self.shed.append(ShedEntry(lane_tag, ShedKind.PREFILL_CHUNK, 0, 0, tokens))
        self.chunks_dropped += 1


def fault_lane(ex: "Executor", st: TickState, tag: int, code: int) -> None:
    """The lane is gone; the tick goes on. Its tag awaits a retire."""
    if tag in st.faulted:
        return
    st.faulted.add(tag)
    st.faults.append(LaneFault(tag, code, 0))
    lane = ex.lanes.pop(tag, None)
    if lane is not None:
        if lane.grammar is not None:
            ex.grammars.release(lane.grammar.handle)
        ex.prim.seq_free(lane.seq)
        ex.faulted.add(tag)
    ex.inject_faults.pop(tag, None)


def unless_fatal(ex: "Executor", e: PrimError, during: str) -> None:
    """A best-effort primitive failed and its caller can do without it; a ``Fatal`` still
    takes the one fatal path (ex.fatal: the worker exits 70 and is replaced)."""
    if isinstance(e, Fatal):
        raise FatalTick(ex.fatal(during))


def admit_fault(ex: "Executor", st: TickState, tag: int, code: int) -> None:
    """An admitted lane that could not get its sequence: the lane faults (the scheduler
    waits or preempts on OOM_TENTATIVE), the tick goes on."""
    st.admit_results.append(AdmitResult(tag, AdmitStatus.ADMITTED, 0, 0, Exactness.SEED_PATH_INVARIANT))
    st.faulted.add(tag)
    st.faults.append(LaneFault(tag, code, 0))
    ex.faulted.add(tag)


def new_seq(ex: "Executor", st: TickState, tag: int, during: str) -> int | None:
    """seq_create for an admitted lane: out of slots or cells is the lane's fault, never a
    FATAL tick; a Fatal takes the fatal path. None: the lane faulted."""
    try:
        return ex.prim.seq_create()
    except PrimError as e:
        code = lane_fault_code(e)
        if code is None:
            raise FatalTick(ex.fatal(during)) from None
        admit_fault(ex, st, tag, code)
        return None


def fail_step(ex: "Executor", st: TickState, tags: list[int], e: PrimError, during: str) -> None:
    """A failed step faults the lanes it carried; a fatal error ends the tick."""
    code = lane_fault_code(e)
    if code is None:
        raise FatalTick(ex.fatal(during))
    for tag in tags:
        fault_lane(ex, st, tag, code)


def run_tick(ex: "Executor", plan: TickPlan, on_partial_emit) -> TickOutcome:
    t_start = time.perf_counter_ns()
    try:
        chk = validate(ex, plan)
        cap = check_capacity(ex, plan, chk)
    except Reject as r:
        return TickOutcome(int(r.status))
    # ---- from here on the plan is carried out
    ex.last_plan_seq = plan.plan_seq
    ex.protected_quota = plan.protected_quota_bytes
    ex.tick_count += 1
    ex.rings.begin_output()
    st = TickState(plan, chk, on_partial_emit)
    try:
        _carry_out(ex, st, cap)
    except FatalTick as f:
        return TickOutcome(int(f.status))
    except Fatal as e:  # one no site caught (e.g. an eviction's export): still the one fatal path
        return TickOutcome(int(ex.fatal(f"the tick's carry-out ({e})")))
    return TickOutcome(int(Status.OK), _events(ex, st, t_start))


def _carry_out(ex: "Executor", st: TickState, cap) -> None:
    from .decode import decode_phase
    from .prefill import prefill_phase

    evicted: list[tuple[int, int]] = []
    for e in cap.victims:
        ex.leave_pool(e, evicted)
    _retire(ex, st)
    ex.settle_cache(evicted)
    # Every eviction, the capacity check's and the cache's own, is a shed entry,
    # so the report reconciles with the memory counters.
    for nbytes, tokens in evicted:
        st.evicted(0, nbytes, tokens)
    for c in st.plan.commits:
        _commit(ex, st, c)
    taken = _take_over(ex, st, cap.taken_over)
    for a in st.plan.admits:
        _admit(ex, st, a, taken)
    ex.sweep_expired_seeds()
    prefill_phase(ex, st)
    decode_phase(ex, st)


def _commit(ex: "Executor", st: TickState, c) -> None:
    """A host-sampled token joins the lane. The host ends a lane on EOS itself (it retires
    it); a grammar, which lives here, advances over the token, and when it ends there the
    lane finishes (its decode this tick only reports that)."""
    lane = ex.lanes[c.lane_tag]
    lane.committed.append(c.token_id)
    lane.pending_input = c.token_id
    lane.pending_logits = None
    lane.rng_counter += 1
    finish = Finish.NONE
    if lane.grammar is not None:
        try:
            if lane.grammar.accept(c.token_id):
                finish = Finish.GRAMMAR
        except GrammarOverflow:  # validation checked the mask; a terminated grammar lands here
            fault_lane(ex, st, c.lane_tag, FaultCode.GRAMMAR_OVERFLOW)
            return
    if finish != Finish.NONE:
        lane.finished = True
        st.commit_finishes[c.lane_tag] = finish


def _retire(ex: "Executor", st: TickState) -> None:
    page = ex.page()
    for r in st.plan.retires:
        if r.lane_tag in ex.faulted:
            ex.faulted.discard(r.lane_tag)
            continue
        lane = ex.lanes.pop(r.lane_tag)
        if lane.grammar is not None:
            ex.grammars.release(lane.grammar.handle)
        if r.publish_to_cache and lane.pending_input is not None:
            try:
                ex.prim.step([Feed(lane.seq, [lane.pending_input], False)])
                lane.pending_input = None
            except PrimError as e:
                unless_fatal(ex, e, "publishing a retired lane's last token")  # else published without it
        ingested = lane.ingested()
        key_len = ingested if ex.desc.exact_only else ingested // page * page
        ex.inject_faults.pop(r.lane_tag, None)
        if not r.publish_to_cache or key_len < 1:
            ex.prim.seq_free(lane.seq)
            continue
        key = lane.committed[:key_len]
        held = ex.prim.seq_len(lane.seq)
        if key_len < held:
            try:
                ex.prim.seq_truncate(lane.seq, key_len)
                held = key_len
            except PrimError as e:
                unless_fatal(ex, e, "cutting a retired lane to its cache key")  # else kept whole
        same = ex.cache.find_tokens(key)
        if same is not None and same.seq is not None:
            # Already cached: the older entry stays (its leases name it) and is used;
            # a keyed lane's key (and the longer retention) carries over to it.
            same.last_used = ex.tick_count
            if lane.cache_key and (not same.key or lane.cache_retention > same.retention):
                same.key, same.retention = lane.cache_key, lane.cache_retention
            ex.prim.seq_free(lane.seq)
            continue
        ex.cache.insert(lane.seq, key, len(lane.prompt), ex.entry_bytes(held), ex.tick_count,
                        lane.cache_key, lane.cache_retention)


def _take_over(ex: "Executor", st: TickState, handles: set[int]) -> set[int]:
    """Entries that admits take whole: they leave the cache, cut to the seed."""
    done = set()
    for a in st.plan.admits:
        if a.seed_handle not in handles:
            continue
        lease = ex.seeds[a.seed_handle]
        n = len(lease.prefix)
        keep = n - 1 if n == len(st.chk.prompts[a.lane_tag]) else n
        e = ex.cache.remove(lease.entry_id)
        if len(e.tokens) != keep:
            try:
                ex.prim.seq_truncate(e.seq, keep)
            except PrimError:
                # validated as possible: a runtime that refuses now cannot be trusted
                ex.prim.seq_free(e.seq)
                raise FatalTick(ex.fatal("a take-over's truncate")) from None
        st.evicted(a.lane_tag, e.bytes, len(e.tokens))
        done.add(a.seed_handle)
        # the lease is consumed by the admit; it no longer pins anything
        lease.entry_id, lease.taken_seq = 0, e.seq
    return done


def _admit(ex: "Executor", st: TickState, a, taken: set[int]) -> None:
    ex.faulted.discard(a.lane_tag)
    prompt = st.chk.prompts[a.lane_tag]
    committed: list[int] = []
    prefilled = 0
    pending = None
    if a.seed_handle:
        lease = ex.seeds.pop(a.seed_handle)
        n = len(lease.prefix)
        full = n == len(prompt)
        if lease.adopted is not None:
            seq = lease.adopted
            ex.bare.discard(seq)
            if full:
                try:
                    ex.prim.seq_truncate(seq, n - 1)
                except PrimError:
                    ex.prim.seq_free(seq)
                    raise FatalTick(ex.fatal("an adopted sequence's truncate")) from None
        elif a.seed_handle in taken:
            seq = lease.taken_seq
        else:
            seq = _seed_copy(ex, st, a, lease, n - 1 if full else n)
            if seq is None:
                return
        if full:
            pending = lease.prefix[-1]
        prefilled = n
        committed = list(lease.prefix)
    else:
        seq = new_seq(ex, st, a.lane_tag, "creating a lane's sequence")
        if seq is None:
            return
    bias = ex.biases.get(a.logit_bias_handle) if a.logit_bias_handle else None
    # A lane drafts when it asked for the strategy and nothing it carries changes a
    # row in a way the draft path does not replay.
    drafts = (
        ex.strategy is not None
        and a.strategy_slot != 0
        and a.sampling != Sampling.HOST
        and a.grammar_handle == 0
        and a.logit_bias_handle == 0
        and a.want_logprobs == 0
    )
    cursor = st.chk.cursors.get(a.lane_tag)
    # A rebuilt lane's replayed tokens were generated, each with one draw: its counter
    # resumes past them, so the same rng_counter_base continues the same text.
    ex.lanes[a.lane_tag] = Lane(
        seq=seq,
        sampling=a.sampling,
        params=a.params,
        rng_base=a.rng_counter_base,
        prompt=prompt,
        prefill_end=max(len(prompt) - a.decode_replay, prefilled),
        prefilled=prefilled,
        rng_counter=a.decode_replay,
        committed=committed,
        pending_input=pending,
        bias=bias,
        logprobs_top=(a.want_logprobs - 1) if a.want_logprobs > 0 else None,
        grammar=ex.grammars.borrow(a.grammar_handle, cursor) if cursor is not None else None,
        spec=LaneSpec.new(ex.strategy) if drafts else None,
        publish_prompt=a.publish_prompt,
        prompt_logprobs_top=(a.want_prompt_logprobs - 1) if a.want_prompt_logprobs > 0 else None,
        cache_key=a.cache_key,
        cache_retention=a.cache_retention,
    )
    st.admit_results.append(
        AdmitResult(
            a.lane_tag,
            AdmitStatus.ADMITTED,
            0,
            ex.strategy.cert_id if drafts else 0,
            Exactness.DISTRIBUTION_EXACT if drafts else Exactness.SEED_PATH_INVARIANT,
        )
    )


def _seed_copy(ex: "Executor", st: TickState, a, lease, copy_len: int) -> int | None:
    """The lane's own sequence from the seed's entry: copied in the pool, or imported
    from host memory and cut to the seed. A failed import prefills afresh: state
    lost, not a request lost."""
    e = ex.cache.get(lease.entry_id)
    seq = new_seq(ex, st, a.lane_tag, "creating a seeded lane's sequence")
    if seq is None:
        e.pins = max(e.pins - 1, 0)
        return None
    out_of_pool = e.seq is None
    placed = True
    failure: PrimError | None = None
    try:
        if copy_len == 0:
            pass
        elif out_of_pool:
            whole = len(e.tokens)
            placed = ex.prim.seq_import(seq, e.exported) == whole
            if placed and copy_len != whole:
                ex.prim.seq_truncate(seq, copy_len)
        else:
            ex.prim.seq_copy(e.seq, seq, copy_len)
    except PrimError as err:
        placed, failure = False, err
    e.pins = max(e.pins - 1, 0)
    if isinstance(failure, Fatal):
        ex.prim.seq_free(seq)
        raise FatalTick(ex.fatal("an import of an exported entry" if out_of_pool else "a seed's copy"))
    if failure is not None and not out_of_pool:
        # The pool could not hold the copy after all (the check counts tokens, the
        # runtime allocates blocks): the lane faults, the entry stays.
        ex.prim.seq_free(seq)
        admit_fault(ex, st, a.lane_tag, lane_fault_code(failure))
        return None
    if not placed:
        # out of the pool: the import failed, so the prefix is prefilled afresh
        try:
            if ex.prim.seq_len(seq) != 0:
                ex.prim.seq_truncate(seq, 0)
            ex.prim.step([Feed(seq, lease.prefix[:copy_len], False)])
        except PrimError as err:
            ex.prim.seq_free(seq)
            fresh_code = lane_fault_code(err)
            if fresh_code is None or not isinstance(err, Capacity):
                raise FatalTick(ex.fatal("prefilling a failed import afresh")) from None
            admit_fault(ex, st, a.lane_tag, fresh_code)  # no room for it after all: the lane waits
            return None
        if e.pins == 0:
            ex.cache.remove(e.entry_id)
            st.evicted(a.lane_tag, 0, len(e.tokens))
        return seq
    if e.share(copy_len):
        e.last_used = ex.tick_count
    e.seeded += 1
    return seq


def _events(ex: "Executor", st: TickState, t_start: int) -> TickEvents:
    if st.faults:
        status = TickStatus.LANE_ERRORS
    elif st.chunks_dropped or st.evictions:
        status = TickStatus.SHED
    else:
        status = TickStatus.OK
    mem = ex.prim.mem_counters()
    page = ex.page()
    completions, ex.completions_pending = ex.completions_pending, []
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
            host_retained_bytes=ex.cache.exported_bytes(),
            pool_blocks_total=mem.cells_total // page,
            pool_blocks_used=mem.cells_used // page,
            pool_bytes_evictable=ex.cache.unpinned_bytes(ex.protected()),
            tentative_bytes=0,
            cache_classes=ex.cache_classes(),
        ),
        logprobs=st.logprobs,
        prompt_logprobs=st.prompt_logprobs,
    )
