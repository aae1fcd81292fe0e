"""Admission: take-overs, then each admit's sequence (fresh, adopted, taken over, copied
or imported from a lease's entry) and its lane.

Invariants:
- A lease that covers the whole prompt starts the lane one token short, the last token
  held back as ``pending_input`` for the first decode (no step is needed to get a row).
- A take-over removes the entry from the cache (a shed entry) and cuts it to the lease.
- A failed import prefills the prefix afresh: state lost, not a request lost.
- A rebuilt lane's decode-replayed tokens were generated with one draw each, so its
  rng counter starts past them and the same rng base continues the same text.
"""

from __future__ import annotations

from ..abi import AdmitResult, AdmitStatus, Exactness, LaneAdmit, Sampling
from ..runtimes.base import Capacity, Fatal, Feed, PrimError
from .context import TickContext
from .faults import admit_fault, fatal_tick, lane_fault_code, new_seq
from .lane import Lane
from .leases import HeldLease
from .speculate import LaneSpec
from .tick_state import TickState


def take_over(c: TickContext, st: TickState, handles: set[int]) -> set[int]:
    """Entries that admits take whole: they leave the cache, cut to the lease."""
    done = set()
    for a in st.plan.admits:
        if a.lease_handle not in handles:
            continue
        lease = c.leases.live[a.lease_handle]
        n = len(lease.prefix)
        keep = n - 1 if n == len(st.chk.prompts[a.lane_tag]) else n
        e = c.pool.cache.remove(lease.entry_id)
        if len(e.tokens) != keep:
            try:
                c.prim.seq_truncate(e.seq, keep)
            except PrimError:
                # validated as possible: a runtime that refuses now cannot be trusted
                c.prim.seq_free(e.seq)
                raise fatal_tick(c, "a take-over's truncate") from None
        st.evicted(a.lane_tag, e.bytes, len(e.tokens))
        done.add(a.lease_handle)
        # the lease is consumed by the admit; it no longer pins anything
        lease.entry_id, lease.taken_seq = 0, e.seq
    return done


def admit(c: TickContext, st: TickState, a: LaneAdmit, taken: set[int]) -> None:
    c.faulted.discard(a.lane_tag)
    prompt = st.chk.prompts[a.lane_tag]
    if a.lease_handle:
        lease = c.leases.consume(a.lease_handle)
        full = len(lease.prefix) == len(prompt)
        seq = _leased_seq(c, st, a, lease, taken, full)
        if seq is None:
            return
        start = _Start(seq, len(lease.prefix), list(lease.prefix), lease.prefix[-1] if full else None)
    else:
        seq = new_seq(c, st, a.lane_tag, "creating a lane's sequence")
        if seq is None:
            return
        start = _Start(seq, 0, [], None)
    drafts = _drafts(c, a)
    c.lanes[a.lane_tag] = _lane(c, st, a, prompt, start, drafts)
    st.admit_results.append(
        AdmitResult(
            a.lane_tag,
            AdmitStatus.ADMITTED,
            0,
            c.spec.config.cert_id if drafts else 0,
            Exactness.DISTRIBUTION_EXACT if drafts else Exactness.SEED_PATH_INVARIANT,
        )
    )


class _Start:
    """Where a new lane starts: its sequence, the prefix it already holds, the held-back token."""

    __slots__ = ("seq", "prefilled", "committed", "pending")

    def __init__(self, seq: int, prefilled: int, committed: list[int], pending: int | None):
        self.seq, self.prefilled, self.committed, self.pending = seq, prefilled, committed, pending


def _leased_seq(c: TickContext, st: TickState, a: LaneAdmit, lease: HeldLease, taken: set[int], full: bool) -> int | None:
    n = len(lease.prefix)
    if lease.adopted is not None:
        seq = lease.adopted
        if full:
            try:
                c.prim.seq_truncate(seq, n - 1)
            except PrimError:
                c.prim.seq_free(seq)
                raise fatal_tick(c, "an adopted sequence's truncate") from None
        return seq
    if a.lease_handle in taken:
        return lease.taken_seq
    return _lease_copy(c, st, a, lease, n - 1 if full else n)


def _drafts(c: TickContext, a: LaneAdmit) -> bool:
    """A lane drafts when it asked for the strategy and nothing it carries changes a row
    in a way the draft path does not replay."""
    return (
        c.spec.config is not None
        and a.strategy_slot != 0
        and a.sampling != Sampling.HOST
        and a.grammar_handle == 0
        and a.logit_bias_handle == 0
        and a.token_rules_handle == 0
        and a.want_logprobs == 0
    )


def _lane(c: TickContext, st: TickState, a: LaneAdmit, prompt: list[int], start: _Start, drafts: bool) -> Lane:
    cursor = st.chk.cursors.get(a.lane_tag)
    return Lane(
        seq=start.seq,
        sampling=a.sampling,
        params=a.params,
        rng_base=a.rng_counter_base,
        prompt=prompt,
        prefill_end=max(len(prompt) - a.decode_replay, start.prefilled),
        prefilled=start.prefilled,
        rng_counter=a.decode_replay,
        committed=start.committed,
        pending_input=start.pending,
        bias=c.biases.get(a.logit_bias_handle) if a.logit_bias_handle else None,
        rules=c.rules.get(a.token_rules_handle) if a.token_rules_handle else None,
        out_start=len(prompt) - a.decode_replay,
        logprobs_top=(a.want_logprobs - 1) if a.want_logprobs > 0 else None,
        grammar=c.grammars.store.borrow(a.grammar_handle, cursor) if cursor is not None else None,
        spec=LaneSpec.new(c.spec.config) if drafts else None,
        publish_prompt=a.publish_prompt,
        prompt_logprobs_top=(a.want_prompt_logprobs - 1) if a.want_prompt_logprobs > 0 else None,
        cache_key=a.cache_key,
        cache_retention=a.cache_retention,
    )


def _lease_copy(c: TickContext, st: TickState, a, lease, copy_len: int) -> int | None:
    """The lane's own sequence from the lease's entry: copied in the pool, or imported
    from host memory and cut to the lease. A failed import prefills afresh: state
    lost, not a request lost."""
    e = c.pool.cache.get(lease.entry_id)
    seq = new_seq(c, st, a.lane_tag, "creating a leased lane's sequence")
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
            placed = c.prim.seq_import(seq, e.exported) == whole
            if placed and copy_len != whole:
                c.prim.seq_truncate(seq, copy_len)
        else:
            c.prim.seq_copy(e.seq, seq, copy_len)
    except PrimError as err:
        placed, failure = False, err
    e.pins = max(e.pins - 1, 0)
    if isinstance(failure, Fatal):
        c.prim.seq_free(seq)
        raise fatal_tick(c, "an import of an exported entry" if out_of_pool else "a lease's copy")
    if failure is not None and not out_of_pool:
        # The pool could not hold the copy after all (the check counts tokens, the
        # runtime allocates blocks): the lane faults, the entry stays.
        c.prim.seq_free(seq)
        admit_fault(c, st, a.lane_tag, lane_fault_code(failure))
        return None
    if not placed:
        # out of the pool: the import failed, so the prefix is prefilled afresh
        try:
            if c.prim.seq_len(seq) != 0:
                c.prim.seq_truncate(seq, 0)
            c.prim.step([Feed(seq, lease.prefix[:copy_len], False)])
        except PrimError as err:
            c.prim.seq_free(seq)
            fresh_code = lane_fault_code(err)
            if fresh_code is None or not isinstance(err, Capacity):
                raise fatal_tick(c, "prefilling a failed import afresh") from None
            admit_fault(c, st, a.lane_tag, fresh_code)  # no room for it after all: the lane waits
            return None
        if e.pins == 0:
            c.pool.cache.remove(e.entry_id)
            st.evicted(a.lane_tag, 0, len(e.tokens))
        return seq
    if e.share(copy_len):
        e.last_used = c.tick_count
    e.leased += 1
    return seq



