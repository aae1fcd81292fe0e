"""Decode rounds: draft, verify, sample; finishes; emits.

A lane granted ``max_new_tokens`` runs up to that many rounds this tick (a verified
draft may add ``overshoot``). Each round feeds every live lane's pending token in one
step (chunks of ``max_batch``). Invariants:
- A row is processed as the reference orders it: grammar mask, logit bias, penalties
  (last 64 tokens, specials exempt), then greedy or a draw at rng_base + rng_counter.
- A drafted round verifies every position and samples each verified row exactly as a
  plain decode would, so drafts change speed, never text; the sequence is cut back to
  what was taken.
- The next round's input waits as each lane's ``pending_input`` when the tick ends early.
"""

from __future__ import annotations

import time

from ..abi import MAX_TOP_LOGPROBS, FaultCode, Finish, LaneEmit, LaneLogprob, RingRef, Sampling, SamplingFlag, SpecStats
from ..rings import RingFull
from ..runtimes.base import Feed, PrimError, SampleSpec
from .. import sampling as hs
from .context import TickContext
from .faults import fail_step, fatal_tick, fault_lane
from .grammar_errors import GrammarOverflow
from .lane import Lane
from .replay import replay_phase
from .rows import DecodeState, Round, finish, greedy, own_row, partial, pick, process_row
from .tick_state import TickState
from .verify import draft, take_verified


def decode_phase(c: TickContext, st: TickState) -> None:
    if c.pace.penalty_exempt is None and any(hs.penalizes(l.params) for l in c.lanes.values()):
        vocab = c.prim.vocabulary()
        c.pace.penalty_exempt = frozenset([i for _, i in vocab.specials] + list(vocab.eos)) if vocab else frozenset()
    rows_from_prefill = len(st.rows)
    t0 = time.perf_counter_ns()
    dc = DecodeState()
    rnd, replaying = _first_round(c, st, dc)
    replay_phase(c, st, replaying, dc.remaining)
    dc.cap_left = {d.lane_tag: d.max_new_tokens + d.overshoot for d in st.plan.decodes}
    gate_lanes = sum(
        1
        for d in st.plan.decodes
        if d.max_new_tokens > 0 and d.lane_tag in c.lanes and c.lanes[d.lane_tag].sampling != Sampling.HOST
    )
    drafting_lanes = any(d.lane_tag in c.lanes and c.lanes[d.lane_tag].spec is not None for d in st.plan.decodes)
    cfg = c.spec.config
    gated = drafting_lanes and cfg is not None and (c.desc.verify_batches or gate_lanes <= 1)
    drafted = _rounds(c, st, dc, rnd, gated and c.spec.gate.allows(cfg, gate_lanes))
    st.decode_ns = time.perf_counter_ns() - t0
    if gated:
        # Only what decode steps produced, and only a tick of a round or more per lane.
        tokens = sum(len(v) for v in dc.out.values()) - rows_from_prefill
        if tokens >= max(gate_lanes, 1):
            c.spec.gate.record(cfg, gate_lanes, drafted, st.decode_ns / 1e9, tokens)
    _emit(c, st, dc)


def _first_round(c: TickContext, st: TickState, dc: DecodeState) -> tuple[list[Round], list[int]]:
    """Each decoding lane's first round input, and the lanes that replay first. A lane
    whose row the prefill kept needs no step for its first token."""
    rnd: list[Round] = []
    replaying: list[int] = []
    for d in st.plan.decodes:
        dc.out[d.lane_tag] = []
        if d.lane_tag in st.faulted or d.lane_tag in st.commit_finishes:
            continue  # gone, or its commit finished it: nothing to step
        code = c.injected.pop(d.lane_tag, None)
        if code is not None:
            fault_lane(c, st, d.lane_tag, code)
            st.rows.pop(d.lane_tag, None)
            continue
        if d.max_new_tokens == 0:
            continue
        lane = c.lanes[d.lane_tag]
        if st.yielded and len(lane.committed) < len(lane.prompt):
            continue
        dc.remaining[d.lane_tag] = d.max_new_tokens
        if len(lane.committed) < len(lane.prompt):
            replaying.append(d.lane_tag)
            continue
        if d.lane_tag in st.rows:
            continue
        if lane.pending_input is None:
            raise fatal_tick(c, "a decode with no input")
        rnd.append(Round(d.lane_tag, [lane.pending_input]))
        lane.pending_input = None
    return rnd, replaying


def _rounds(c: TickContext, st: TickState, dc: DecodeState, rnd: list[Round], drafts_allowed: bool) -> bool:
    """Decode rounds until every lane is done or a yield; True if any round drafted."""
    drafted = False
    while True:
        drafts = draft(c, rnd, dc) if drafts_allowed else {}
        drafted |= bool(drafts)
        _step_round(c, st, dc, rnd, drafts)
        rnd = _sample_round(c, st, dc)
        for tag in dc.grammar_faults:
            dc.remaining.pop(tag, None)
            rnd = [f for f in rnd if f.tag != tag]
            fault_lane(c, st, tag, FaultCode.GRAMMAR_OVERFLOW)
        dc.grammar_faults.clear()
        for tag in dc.faults_oob:
            fault_lane(c, st, tag, FaultCode.REF_SPAN_OOB)
        dc.faults_oob.clear()
        if not rnd:
            return drafted
        if c.rings.yield_requested():
            for f in rnd:  # the next round's inputs wait as each lane's pending token
                c.lanes[f.tag].pending_input = f.tokens[0]
                dc.remaining.pop(f.tag, None)
            return drafted


def _fail_chunk(c: TickContext, st: TickState, dc: DecodeState, chunk: list[Round], e: PrimError, during: str) -> None:
    fail_step(c, st, [f.tag for f in chunk], e, during)
    for f in chunk:
        dc.remaining.pop(f.tag, None)


def _runtime_spec(lane: Lane, draws: bool) -> SampleSpec | None:
    """A lane the runtime can sample for: nothing host-side touches its row."""
    is_greedy = greedy(lane)
    if (
        lane.sampling == Sampling.HOST
        or (not is_greedy and not draws)
        or lane.bias is not None
        or lane.rules is not None
        or hs.penalizes(lane.params)
        or lane.logprobs_top is not None
        or lane.grammar is not None
    ):
        return None
    p = lane.params
    return SampleSpec(0.0 if is_greedy else p.temperature, p.top_k, p.top_p, p.min_p, lane.rng_base + lane.rng_counter)


def _step_round(c: TickContext, st: TickState, dc: DecodeState, rnd: list[Round], drafts: dict[int, list[int]]) -> None:
    batch = max(c.desc.max_batch, 1)
    for i in range(0, len(rnd), batch):
        chunk = rnd[i : i + batch]
        feeds = [Feed(c.lanes[f.tag].seq, f.tokens, True) for f in chunk]
        if any(f.tag in drafts for f in chunk):
            try:
                got = c.prim.step_rows(feeds)
            except PrimError as e:
                _fail_chunk(c, st, dc, chunk, e, "a draft verification")
                continue
            if got is None:
                raise fatal_tick(c, "a draft verification the runtime declared")
            if len(got) != len(chunk) or any(len(r) != len(f.tokens) for r, f in zip(got, chunk)):
                raise fatal_tick(c, "a draft verification's rows")
            for f, lane_rows in zip(chunk, got):
                if f.tag in drafts:
                    dc.spec_rows[f.tag] = (lane_rows, drafts.pop(f.tag))
                else:
                    st.rows[f.tag] = lane_rows[-1]
            continue
        if c.desc.engine_sampling:
            specs = [_runtime_spec(c.lanes[f.tag], c.desc.engine_draws) for f in chunk]
            if all(s is not None for s in specs):
                try:
                    tokens = c.prim.step_sampled(feeds, specs)
                except PrimError as e:
                    _fail_chunk(c, st, dc, chunk, e, "a decode step")
                    continue
                if tokens is not None:
                    if len(tokens) != len(chunk):
                        raise fatal_tick(c, "a sampled step's tokens")
                    for f, t in zip(chunk, tokens):
                        dc.picked[f.tag] = int(t)
                    continue
        try:
            got = c.prim.step(feeds)
        except PrimError as e:
            _fail_chunk(c, st, dc, chunk, e, "a decode step")
            continue
        if len(got) != len(chunk):
            raise fatal_tick(c, "a decode step's rows")
        for f, row in zip(chunk, got):
            st.rows[f.tag] = row


def _from_row(c: TickContext, st: TickState, dc: DecodeState, tag: int, lane: Lane) -> int | None:
    """The token from the lane's row, in the reference's order: grammar mask, bias,
    penalties, then the pick (logprobs from the processed row). None: no token this
    round (a grammar fault, or a host lane whose row went out for the host to pick)."""
    row = own_row(c, lane, st.rows.pop(tag))
    if lane.grammar is not None:
        try:
            lane.grammar.mask(row)
        except GrammarOverflow:
            dc.grammar_faults.append(tag)
            return None
    process_row(c, lane, row)
    if lane.sampling == Sampling.HOST:
        # The host gets the row as far as this side's order goes (mask, bias,
        # penalties) and picks from it: the same pick gives the same token.
        dc.remaining.pop(tag, None)
        try:
            lane.pending_logits = c.rings.write_logits_row(row)
        except RingFull:
            dc.faults_oob.append(tag)
        return None
    token = pick(lane, row)
    if lane.logprobs_top is not None:
        lp, top = hs.logprobs(row, token, min(lane.logprobs_top, MAX_TOP_LOGPROBS))
        dc.logprob[tag] = LaneLogprob(tag, token, lp, [i for i, _ in top], [v for _, v in top])
        st.logprobs.append(dc.logprob[tag])
    return token


def _sample_round(c: TickContext, st: TickState, dc: DecodeState) -> list[Round]:
    nxt: list[Round] = []
    tags = sorted(set(st.rows) | set(dc.picked) | set(dc.spec_rows))
    for tag in tags:
        if tag in dc.spec_rows:
            take_verified(c, st, dc, tag, nxt)
            continue
        lane = c.lanes[tag]
        if len(lane.committed) >= c.desc.max_seq_len:
            dc.picked.pop(tag, None)
            st.rows.pop(tag, None)
            finish(lane, dc, tag, Finish.LENGTH)
            continue
        token = dc.picked.pop(tag, None)
        if token is None:
            token = _from_row(c, st, dc, tag, lane)
            if token is None:
                continue
        lane.committed.append(token)
        lane.rng_counter += 1
        grammar_done = False
        if lane.grammar is not None:
            try:
                grammar_done = lane.grammar.accept(token)
            except GrammarOverflow:
                dc.grammar_faults.append(tag)
        dc.out[tag].append(token)
        dc.cap_left[tag] = max(dc.cap_left.get(tag, 0) - 1, 0)
        partial(st, tag, token, dc.logprob.pop(tag, None))
        dc.remaining[tag] -= 1
        lane.pending_input = token
        if not lane.params.flags & SamplingFlag.IGNORE_EOS and c.prim.is_eos(token):
            finish(lane, dc, tag, Finish.EOS)
        elif grammar_done:
            finish(lane, dc, tag, Finish.GRAMMAR)
        elif len(lane.committed) >= c.desc.max_seq_len:
            finish(lane, dc, tag, Finish.LENGTH)
        elif dc.remaining[tag] == 0:
            dc.remaining.pop(tag)
        elif tag not in dc.grammar_faults:
            lane.pending_input = None
            nxt.append(Round(tag, [token]))
    return nxt


def _emit(c: TickContext, st: TickState, dc: DecodeState) -> None:
    for d in st.plan.decodes:
        if d.lane_tag in st.faulted:
            continue
        lane = c.lanes[d.lane_tag]
        finish = dc.finishes.get(d.lane_tag, st.commit_finishes.get(d.lane_tag, Finish.NONE))
        if lane.sampling == Sampling.HOST:
            st.emits.append(LaneEmit(d.lane_tag, RingRef(), 0, finish, lane.pending_logits or RingRef(), SpecStats()))
            continue
        tokens = dc.out.get(d.lane_tag, [])
        try:
            ref = c.rings.write_tokens(tokens)
        except RingFull:
            fault_lane(c, st, d.lane_tag, FaultCode.REF_SPAN_OOB)
            continue
        stats = dc.spec_stats.get(d.lane_tag)
        spec = SpecStats(stats[0], stats[1], c.spec.config.cert_id) if stats and lane.spec is not None else SpecStats()
        st.emits.append(LaneEmit(d.lane_tag, ref, len(tokens), finish, RingRef(), spec))
