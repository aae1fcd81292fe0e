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
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..abi import MAX_TOP_LOGPROBS, PromptLogprob
from ..runtimes.base import Feed, PrimError
from .sampling import logprobs as score
from .tick import FatalTick, TickState, fail_step, unless_fatal

if TYPE_CHECKING:
    from .executor import Executor

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


def _step_cap(ex: "Executor") -> int:
    n = ex.desc.prefill_step_tokens
    if n == 0:
        return 1 << 62
    spt = ex.prefill_secs_per_token
    if spt and ex.rings.latency_wanted():
        fits = int(LATENCY_STEP_SECS / spt) // LATENCY_STEP_UNIT * LATENCY_STEP_UNIT
        return min(max(fits, LATENCY_STEP_UNIT), max(n, LATENCY_STEP_UNIT))
    return n


def checkpoint_prompt(ex: "Executor", tag: int, min_tokens: int = CHECKPOINT_MIN_TOKENS) -> None:
    """A copy of the lane's state where its prompt ends, less the held-back token
    (whole pages of it on a paged runtime, where a copy shares the blocks)."""
    lane = ex.lanes.get(tag)
    if lane is None:
        return
    n = lane.ingested()
    if not ex.desc.exact_only:
        n = n // ex.page() * ex.page()
    tokens = lane.committed[:n]
    if n < max(min_tokens, 1) or ex.cache.find_tokens(tokens) is not None:
        return
    try:  # best effort: without room the prompt is simply not cached; a Fatal still is fatal
        dst = ex.prim.seq_create()
    except PrimError as e:
        unless_fatal(ex, e, "publishing a prompt (create)")
        return
    try:
        ex.prim.seq_copy(lane.seq, dst, n)
    except PrimError as e:
        ex.prim.seq_free(dst)
        unless_fatal(ex, e, "publishing a prompt (copy)")
        return
    ex.cache.insert(dst, tokens, len(lane.prompt), ex.entry_bytes(n), ex.tick_count, lane.cache_key, lane.cache_retention)


def prefill_phase(ex: "Executor", st: TickState) -> None:
    t0 = time.perf_counter_ns()
    plan = st.plan
    decode_tags = {d.lane_tag for d in plan.decodes if d.max_new_tokens > 0}
    budget = plan.prefill_token_budget
    work: list[_Work] = []
    for p in plan.prefills:
        take = min(p.token_count, budget)
        budget -= take
        if p.token_count > take:
            st.dropped(p.lane_tag, p.token_count - take)
        if take > 0:
            work.append(_Work(p.lane_tag, p.token_offset, p.token_offset + take))
    step_cap = _step_cap(ex)
    if step_cap < (1 << 62):
        spt = ex.prefill_secs_per_token
        ex.prim.sync_steps(ex.rings.latency_wanted() or spt is None or spt * step_cap >= SYNC_STEP_SECS)
    ran = 0
    stepped = False
    while any(w.next < w.end for w in work):
        if stepped and ex.rings.yield_requested():
            for w in work:
                if w.next < w.end:
                    st.dropped(w.tag, w.end - w.next)
            st.yielded = True
            break
        stepped = True
        planned: list[_Planned] = []
        checkpoints: list[int] = []
        publishes: list[int] = []  # paged lanes whose prompt forks will share
        left = step_cap
        for w in work:
            if w.next >= w.end or left == 0:
                continue
            if w.tag in st.faulted:
                w.next = w.end
                continue
            take = min(w.end - w.next, left)
            left -= take
            ran += take
            lane = ex.lanes[w.tag]
            start = lane.ingested()
            chunk = lane.prompt[w.next : w.next + take]
            completes = w.next + take == len(lane.prompt)
            w.next += take
            feed = [] if lane.pending_input is None else [lane.pending_input]
            lane.pending_input = None
            checkpoint = completes and ex.desc.exact_only and len(lane.prompt) >= 2
            wants_row = completes and w.tag in decode_tags and not checkpoint
            if checkpoint:
                checkpoints.append(w.tag)
            elif completes and lane.publish_prompt and not ex.desc.exact_only:
                publishes.append(w.tag)
            if completes and not wants_row:
                feed += chunk[:-1]
                lane.pending_input = chunk[-1]
            else:
                feed += chunk
            lane.committed += chunk
            lane.prefilled += take
            if feed:
                planned.append(_Planned(w.tag, feed, wants_row, start, lane.prompt_logprobs_top is not None))
        if not planned:
            continue
        plain = [f for f in planned if not f.scored]
        if plain and not _step(ex, st, plain):
            continue
        scored = [f for f in planned if f.scored]
        if scored and not _step_scored(ex, st, scored):
            continue
        for tag in checkpoints:  # a prompt whose forks wait for it is worth a checkpoint at any length
            lane = ex.lanes.get(tag)
            checkpoint_prompt(ex, tag, min_tokens=1 if lane is not None and lane.publish_prompt else CHECKPOINT_MIN_TOKENS)
        for tag in publishes:
            checkpoint_prompt(ex, tag, min_tokens=1)
    st.prefill_ns = time.perf_counter_ns() - t0
    if ran >= LATENCY_STEP_UNIT:
        sample = st.prefill_ns / 1e9 / ran
        prev = ex.prefill_secs_per_token
        ex.prefill_secs_per_token = sample if prev is None else 0.7 * prev + 0.3 * sample


def _step(ex: "Executor", st: TickState, planned: list[_Planned]) -> bool:
    try:
        got = ex.prim.step([Feed(ex.lanes[f.tag].seq, f.tokens, f.wants_row) for f in planned])
    except PrimError as e:
        fail_step(ex, st, [f.tag for f in planned], e, "a prefill step")
        return False
    wanted = [f for f in planned if f.wants_row]
    if len(got) != len(wanted):
        raise FatalTick(ex.fatal("a prefill step's rows"))
    for f, row in zip(wanted, got):
        st.rows[f.tag] = row
    return True


def _step_scored(ex: "Executor", st: TickState, planned: list[_Planned]) -> bool:
    """A prefill step with every position's row: each scores the prompt token after it."""
    try:
        got = ex.prim.step_rows([Feed(ex.lanes[f.tag].seq, f.tokens, True) for f in planned])
    except PrimError as e:
        fail_step(ex, st, [f.tag for f in planned], e, "a prefill step")
        return False
    if got is None:  # the runtime cannot give every row: the prompt goes unscored
        return _step(ex, st, planned)
    if len(got) != len(planned) or any(len(r) != len(f.tokens) for f, r in zip(planned, got)):
        raise FatalTick(ex.fatal("a scored prefill step's rows"))
    for f, rows in zip(planned, got):
        lane = ex.lanes[f.tag]
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


def replay_phase(ex: "Executor", st: TickState, replaying: list[int], remaining: dict[int, int]) -> None:
    """Feed the last ``decode_replay`` prompt tokens through decode-shaped steps, one
    per round, so a rebuilt lane's state is computed as it first was. Each replayed
    token spends one of the lane's rounds this tick."""
    yield_after_pass = False
    while True:
        passing: list[_Planned] = []
        for tag in replaying:
            if remaining.get(tag, 0) <= 0 or tag not in ex.lanes:
                continue
            lane = ex.lanes[tag]
            at = len(lane.committed)
            if at >= len(lane.prompt):
                continue
            token = lane.prompt[at]
            last = at + 1 == len(lane.prompt)
            lane.committed.append(token)
            remaining[tag] -= 1
            if last and remaining[tag] == 0:
                lane.pending_input = token
            else:
                passing.append(_Planned(tag, [token], last))
        if not passing:
            break
        if yield_after_pass and ex.rings.yield_requested():
            for f in passing:
                ex.lanes[f.tag].committed.pop()
                remaining[f.tag] += 1
            break
        yield_after_pass = True
        batch = max(ex.desc.max_batch, 1)
        for i in range(0, len(passing), batch):
            chunk = passing[i : i + batch]
            try:
                got = ex.prim.step([Feed(ex.lanes[f.tag].seq, f.tokens, f.wants_row) for f in chunk])
            except PrimError as e:
                fail_step(ex, st, [f.tag for f in chunk], e, "a decode step")
                for f in chunk:
                    remaining.pop(f.tag, None)
                continue
            it = iter(got)
            for f in chunk:
                if f.wants_row:
                    st.rows[f.tag] = next(it)
    for tag in replaying:
        if remaining.get(tag) == 0:
            remaining.pop(tag)
