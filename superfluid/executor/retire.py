"""The carry-out's first steps: retires (publish to the cache or free) and commits of
host-sampled tokens.

Invariants:
- A publishing retire caches the lane's ingested tokens, whole pages on a paged runtime,
  exact on a recurrent one; a key already cached keeps its older entry (leases name it).
- A commit's token joins the lane as its next input; a grammar that ends on it
  finishes the lane (its decode this tick only reports that).
"""

from __future__ import annotations

from ..abi import Finish, FaultCode, HostCommit
from ..runtimes.base import Feed, PrimError
from .context import TickContext
from .faults import fault_lane, unless_fatal
from .grammar_errors import GrammarOverflow
from .tick_state import TickState


def commit(c: TickContext, st: TickState, cm: HostCommit) -> None:
    """A host-sampled token joins the lane. The host ends a lane on EOS itself (it retires
    it); a grammar, which lives here, advances over the token, and when it ends there the
    lane finishes (its decode this tick only reports that)."""
    lane = c.lanes[cm.lane_tag]
    lane.committed.append(cm.token_id)
    lane.pending_input = cm.token_id
    lane.pending_logits = None
    lane.rng_counter += 1
    finish = Finish.NONE
    if lane.grammar is not None:
        try:
            if lane.grammar.accept(cm.token_id):
                finish = Finish.GRAMMAR
        except GrammarOverflow:  # validation checked the mask; a terminated grammar lands here
            fault_lane(c, st, cm.lane_tag, FaultCode.GRAMMAR_OVERFLOW)
            return
    if finish != Finish.NONE:
        lane.finished = True
        st.commit_finishes[cm.lane_tag] = finish


def retire(c: TickContext, st: TickState) -> None:
    page = c.pool.page
    for r in st.plan.retires:
        if r.lane_tag in c.faulted:
            c.faulted.discard(r.lane_tag)
            continue
        lane = c.lanes.pop(r.lane_tag)
        if lane.grammar is not None:
            c.grammars.release(lane.grammar.handle)
        if r.publish_to_cache and lane.pending_input is not None:
            try:
                c.prim.step([Feed(lane.seq, [lane.pending_input], False)])
                lane.pending_input = None
            except PrimError as e:
                unless_fatal(c, e, "publishing a retired lane's last token")  # else published without it
        ingested = lane.ingested()
        key_len = ingested if c.desc.exact_only else ingested // page * page
        c.injected.pop(r.lane_tag, None)
        if not r.publish_to_cache or key_len < 1:
            c.prim.seq_free(lane.seq)
            continue
        key = lane.committed[:key_len]
        held = c.prim.seq_len(lane.seq)
        if key_len < held:
            try:
                c.prim.seq_truncate(lane.seq, key_len)
                held = key_len
            except PrimError as e:
                unless_fatal(c, e, "cutting a retired lane to its cache key")  # else kept whole
        same = c.pool.cache.find_tokens(key)
        if same is not None and same.seq is not None:
            # Already cached: the older entry stays (its leases name it) and is used;
            # a keyed lane's key (and the longer retention) carries over to it.
            same.last_used = c.tick_count
            if lane.cache_key and (not same.key or lane.cache_retention > same.retention):
                same.key, same.retention = lane.cache_key, lane.cache_retention
            c.prim.seq_free(lane.seq)
            continue
        c.pool.cache.insert(lane.seq, key, len(lane.prompt), c.pool.entry_bytes(held), c.tick_count,
                        lane.cache_key, lane.cache_retention)


