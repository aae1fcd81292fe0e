"""Prefill: this tick's chunks under the token budget, in steps a yield can end.

Invariants:
- A chunk cut by the budget or a yield is a PREFILL_CHUNK shed entry; the lane keeps
  what it prefilled and the scheduler re-plans the rest from ``token_offset``.
- When a chunk completes the prompt and the lane decodes this tick, its last token's
  row is kept (the first token costs no decode step). Otherwise the prompt's last
  token is held back as ``pending_input`` for the first decode.
- On a recurrent runtime the completed prompt is checkpointed one token short of its
  end: a resent prompt or the next turn starts there.
- A lane that wants prompt logprobs is stepped for every position's row (``step_rows``):
  the row at position p scores prompt token p + 1. Its last row doubles as the row the
  first decode samples from, so scoring changes no token.
- Running lanes ride along: the first prefill step also feeds each decoding lane's
  pending token and keeps its row, so their first round costs no step of its own
  (there is no prefill phase, only tokens to catch up: one runtime step carries both,
  as one weight pass). The row is the one the first round would have stepped for: the
  same input on the same history, so the token is too wherever rows do not depend on
  the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..abi import MAX_TOP_LOGPROBS, PromptLogprob
from ..runtimes.base import Feed, PrimError
from ..sampling import logprobs as score
from .context import TickContext
from .faults import fail_step, fatal_tick, unless_fatal
from .tick_state import TickState

CHECKPOINT_MIN_TOKENS = 128  # a shorter prompt costs little to run again
LATENCY_STEP_SECS = 0.3  # while latency matters, a prefill step is about this long
LATENCY_STEP_UNIT = 128  # short steps are whole multiples of this, never fewer
SYNC_STEP_SECS = 0.5  # a step at least this long is waited out before the next


@dataclass
class _Work:
    tag: int
    next: int
    end: int


@dataclass
class _Planned:
    tag: int
    tokens: list[int]
    wants_row: bool
    start: int = 0  # the position of tokens[0] in the lane's history
    scored: bool = False  # every position's row: prompt logprobs


def _step_cap(c: TickContext) -> int:
    n = c.desc.prefill_step_tokens
    if n == 0:
        return 1 << 62
    spt = c.pace.prefill_secs_per_token
    if spt and c.rings.latency_wanted():
        fits = int(LATENCY_STEP_SECS / spt) // LATENCY_STEP_UNIT * LATENCY_STEP_UNIT
        return min(max(fits, LATENCY_STEP_UNIT), max(n, LATENCY_STEP_UNIT))
    return n


def checkpoint_prompt(c: TickContext, tag: int, min_tokens: int = CHECKPOINT_MIN_TOKENS) -> None:
    """A copy of the lane's state where its prompt ends, less the held-back token
    (whole pages of it on a paged runtime, where a copy shares the blocks)."""
    lane = c.lanes.get(tag)
    if lane is None:
        return
    n = lane.ingested()
    if not c.desc.exact_only:
        n = n // c.pool.page * c.pool.page
    tokens = lane.committed[:n]
    if n < max(min_tokens, 1) or c.pool.cache.find_tokens(tokens) is not None:
        return
    try:  # best effort: without room the prompt is simply not cached; a Fatal still is fatal
        dst = c.prim.seq_create()
    except PrimError as e:
        unless_fatal(c, e, "publishing a prompt (create)")
        return
    try:
        c.prim.seq_copy(lane.seq, dst, n)
    except PrimError as e:
        c.prim.seq_free(dst)
        unless_fatal(c, e, "publishing a prompt (copy)")
        return
    c.pool.cache.insert(dst, tokens, len(lane.prompt), c.pool.entry_bytes(n), c.tick_count, lane.cache_key, lane.cache_retention)


def prefill_phase(c: TickContext, st: TickState) -> None:
    t0 = time.perf_counter_ns()
    work = _budgeted(st)
    step_cap = _step_cap(c)
    if step_cap < (1 << 62):
        spt = c.pace.prefill_secs_per_token
        c.prim.sync_steps(c.rings.latency_wanted() or spt is None or spt * step_cap >= SYNC_STEP_SECS)
    decode_tags = {d.lane_tag for d in st.plan.decodes if d.max_new_tokens > 0}
    ran = 0
    stepped = False
    while any(w.next < w.end for w in work):
        if stepped and c.rings.yield_requested():
            for w in work:
                if w.next < w.end:
                    st.dropped(w.tag, w.end - w.next)
            st.yielded = True
            break
        first, stepped = not stepped, True
        step = _plan_step(c, st, work, step_cap, decode_tags)
        if first:
            step.feeds += _riders(c, st, {w.tag for w in work}, max(c.desc.max_batch, 1) - len(step.feeds))
        ran += step.tokens
        _run_step(c, st, step)
    st.prefill_ns = time.perf_counter_ns() - t0
    if ran >= LATENCY_STEP_UNIT:
        sample = st.prefill_ns / 1e9 / ran
        prev = c.pace.prefill_secs_per_token
        c.pace.prefill_secs_per_token = sample if prev is None else 0.7 * prev + 0.3 * sample


def _budgeted(st: TickState) -> list[_Work]:
    """The plan's chunks cut to its token budget; what the budget cuts is shed."""
    budget = st.plan.prefill_token_budget
    work: list[_Work] = []
    for p in st.plan.prefills:
        take = min(p.token_count, budget)
        budget -= take
        if p.token_count > take:
            st.dropped(p.lane_tag, p.token_count - take)
        if take > 0:
            work.append(_Work(p.lane_tag, p.token_offset, p.token_offset + take))
    return work


def _riders(c: TickContext, st: TickState, prefilling: set[int], room: int) -> list[_Planned]:
    """Up to ``room`` decoding lanes (a step carries at most max_batch feeds) whose first
    round can ride in the first prefill step: fully prefilled before this tick, with a
    pending token, and nothing the decode phase must see first (a fault, a commit's
    finish, an injected fault, a replay)."""
    riders: list[_Planned] = []
    for d in st.plan.decodes:
        if len(riders) >= room:
            break
        tag = d.lane_tag
        if d.max_new_tokens <= 0 or tag in prefilling or tag in st.faulted or tag in st.commit_finishes:
            continue
        lane = c.lanes[tag]  # a decode names a live lane unless it faulted (above)
        if tag in c.injected or lane.pending_input is None:
            continue
        if len(lane.committed) < len(lane.prompt):
            continue  # decode-replays first
        riders.append(_Planned(tag, [lane.pending_input], True, lane.ingested()))
        lane.pending_input = None
    return riders


@dataclass
class _Step:
    feeds: list[_Planned] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # recurrent lanes whose prompt completes
    publishes: list[int] = field(default_factory=list)  # paged lanes whose prompt forks will share
    tokens: int = 0


def _plan_step(c: TickContext, st: TickState, work: list[_Work], step_cap: int, decode_tags: set[int]) -> _Step:
    """The next step's feeds, at most ``step_cap`` tokens; the lanes advance as planned."""
    step = _Step()
    left = step_cap
    for w in work:
        if w.next >= w.end or left == 0:
            continue
        if w.tag in st.faulted:
            w.next = w.end
            continue
        take = min(w.end - w.next, left)
        left -= take
        step.tokens += take
        lane = c.lanes[w.tag]
        start = lane.ingested()
        chunk = lane.prompt[w.next : w.next + take]
        completes = w.next + take == len(lane.prompt)
        w.next += take
        feed = [] if lane.pending_input is None else [lane.pending_input]
        lane.pending_input = None
        checkpoint = completes and c.desc.exact_only and len(lane.prompt) >= 2
        wants_row = completes and w.tag in decode_tags and not checkpoint
        if checkpoint:
            step.checkpoints.append(w.tag)
        elif completes and lane.publish_prompt and not c.desc.exact_only:
            step.publishes.append(w.tag)
        if completes and not wants_row:
            feed += chunk[:-1]
            lane.pending_input = chunk[-1]
        else:
            feed += chunk
        lane.committed += chunk
        lane.prefilled += take
        if feed:
            step.feeds.append(_Planned(w.tag, feed, wants_row, start, lane.prompt_logprobs_top is not None))
    return step


def _run_step(c: TickContext, st: TickState, step: _Step) -> None:
    if not step.feeds:
        return
    plain = [f for f in step.feeds if not f.scored]
    if plain and not _step(c, st, plain):
        return
    scored = [f for f in step.feeds if f.scored]
    if scored and not _step_scored(c, st, scored):
        return
    for tag in step.checkpoints:  # a prompt whose forks wait for it is worth a checkpoint at any length
        lane = c.lanes.get(tag)
        checkpoint_prompt(c, tag, min_tokens=1 if lane is not None and lane.publish_prompt else CHECKPOINT_MIN_TOKENS)
    for tag in step.publishes:
        checkpoint_prompt(c, tag, min_tokens=1)


def _step(c: TickContext, st: TickState, planned: list[_Planned]) -> bool:
    try:
        got = c.prim.step([Feed(c.lanes[f.tag].seq, f.tokens, f.wants_row) for f in planned])
    except PrimError as e:
        fail_step(c, st, [f.tag for f in planned], e, "a prefill step")
        return False
    wanted = [f for f in planned if f.wants_row]
    if len(got) != len(wanted):
        raise fatal_tick(c, "a prefill step's rows")
    for f, row in zip(wanted, got):
        st.rows[f.tag] = row
    return True


def _step_scored(c: TickContext, st: TickState, planned: list[_Planned]) -> bool:
    """A prefill step with every position's row: each scores the prompt token after it."""
    try:
        got = c.prim.step_rows([Feed(c.lanes[f.tag].seq, f.tokens, True) for f in planned])
    except PrimError as e:
        fail_step(c, st, [f.tag for f in planned], e, "a prefill step")
        return False
    if got is None:  # the runtime cannot give every row: the prompt goes unscored
        return _step(c, st, planned)
    if len(got) != len(planned) or any(len(r) != len(f.tokens) for f, r in zip(planned, got)):
        raise fatal_tick(c, "a scored prefill step's rows")
    for f, rows in zip(planned, got):
        lane = c.lanes[f.tag]
        k = min(lane.prompt_logprobs_top or 0, MAX_TOP_LOGPROBS)
        for i, row in enumerate(rows):
            pos = f.start + i + 1
            if pos < len(lane.prompt):
                token = lane.prompt[pos]
                lp, top = score(row, token, k)
                st.prompt_logprobs.append(PromptLogprob(f.tag, pos, token, lp, [t for t, _ in top], [v for _, v in top]))
        if f.wants_row:
            st.rows[f.tag] = rows[-1]
    return True
