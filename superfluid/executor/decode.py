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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..abi import (
    MAX_TOP_LOGPROBS,
    FaultCode,
    Finish,
    LaneEmit,
    LaneLogprob,
    RingRef,
    Sampling,
    SamplingFlag,
    SpecStats,
    TickFlag,
)
from ..rings import RingFull
from ..runtimes.base import Feed, PrimError, SampleSpec
from . import sampling as hs
from .grammar_errors import GrammarOverflow
from .speculate import propose
from .context import TickContext
from .faults import fail_step, fatal_tick, fault_lane
from .lane import Lane
from .tick_state import TickState

@dataclass
class _Round:
    tag: int
    tokens: list[int]


@dataclass
class _Decode:
    """Per-tick decode bookkeeping."""

    remaining: dict[int, int] = field(default_factory=dict)  # rounds left per lane
    cap_left: dict[int, int] = field(default_factory=dict)  # tokens left incl. overshoot
    out: dict[int, list[int]] = field(default_factory=dict)  # emitted this tick
    finishes: dict[int, int] = field(default_factory=dict)
    picked: dict[int, int] = field(default_factory=dict)  # tokens the runtime sampled
    spec_rows: dict[int, tuple[list[np.ndarray], list[int]]] = field(default_factory=dict)
    spec_stats: dict[int, list[int]] = field(default_factory=dict)  # [proposed, accepted]
    grammar_faults: list[int] = field(default_factory=list)
    faults_oob: list[int] = field(default_factory=list)  # host rows the logits ring had no room for


def _greedy(lane: Lane) -> bool:
    return lane.sampling == Sampling.GREEDY or lane.params.temperature <= 0.0


def _runtime_spec(lane: Lane, draws: bool) -> SampleSpec | None:
    """A lane the runtime can sample for: nothing host-side touches its row."""
    greedy = _greedy(lane)
    if (
        lane.sampling == Sampling.HOST
        or (not greedy and not draws)
        or lane.bias is not None
        or hs.penalizes(lane.params)
        or lane.logprobs_top is not None
        or lane.grammar is not None
    ):
        return None
    p = lane.params
    return SampleSpec(0.0 if greedy else p.temperature, p.top_k, p.top_p, p.min_p, lane.rng_base + lane.rng_counter)


def decode_phase(c: TickContext, st: TickState) -> None:
    if c.pace.penalty_exempt is None and any(hs.penalizes(l.params) for l in c.lanes.values()):
        vocab = c.prim.vocabulary()
        c.pace.penalty_exempt = frozenset([i for _, i in vocab.specials] + list(vocab.eos)) if vocab else frozenset()
    rows_from_prefill = len(st.rows)
    t0 = time.perf_counter_ns()
    dc = _Decode()
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


def _first_round(c: TickContext, st: TickState, dc: _Decode) -> tuple[list[_Round], list[int]]:
    """Each decoding lane's first round input, and the lanes that replay first. A lane
    whose row the prefill kept needs no step for its first token."""
    rnd: list[_Round] = []
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
        rnd.append(_Round(d.lane_tag, [lane.pending_input]))
        lane.pending_input = None
    return rnd, replaying


def _rounds(c: TickContext, st: TickState, dc: _Decode, rnd: list[_Round], drafts_allowed: bool) -> bool:
    """Decode rounds until every lane is done or a yield; True if any round drafted."""
    drafted = False
    while True:
        drafts = _draft(c, rnd, dc) if drafts_allowed else {}
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


def replay_phase(c: TickContext, st: TickState, replaying: list[int], remaining: dict[int, int]) -> None:
    """Feed the last ``decode_replay`` prompt tokens through decode-shaped steps, one
    per round, so a rebuilt lane's state is computed as it first was. Each replayed
    token spends one of the lane's rounds this tick."""
    yield_after_pass = False
    while True:
        passing: list[tuple[int, int, bool]] = []  # (lane, token, wants_row)
        for tag in replaying:
            if remaining.get(tag, 0) <= 0 or tag not in c.lanes:
                continue
            lane = c.lanes[tag]
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
                passing.append((tag, token, last))
        if not passing:
            break
        if yield_after_pass and c.rings.yield_requested():
            for tag, _, _ in passing:
                c.lanes[tag].committed.pop()
                remaining[tag] += 1
            break
        yield_after_pass = True
        batch = max(c.desc.max_batch, 1)
        for i in range(0, len(passing), batch):
            chunk = passing[i : i + batch]
            try:
                got = c.prim.step([Feed(c.lanes[tag].seq, [token], wants) for tag, token, wants in chunk])
            except PrimError as e:
                fail_step(c, st, [tag for tag, _, _ in chunk], e, "a decode step")
                for tag, _, _ in chunk:
                    remaining.pop(tag, None)
                continue
            it = iter(got)
            for tag, _, wants in chunk:
                if wants:
                    st.rows[tag] = next(it)
    for tag in replaying:
        if remaining.get(tag) == 0:
            remaining.pop(tag)


def _draft(c: TickContext, rnd: list[_Round], dc: _Decode) -> dict[int, list[int]]:
    mem = c.prim.mem_counters()
    reserved = sum(dc.remaining.values())
    spare = (1 << 62) if mem.cells_total == 0 else max(mem.cells_total - mem.cells_used - reserved, 0)
    drafts = {}
    for f in rnd:
        lane = c.lanes[f.tag]
        if lane.spec is None or not lane.spec.drafting():
            continue
        room = c.desc.max_seq_len - (len(lane.committed) + 1)
        k = min(lane.spec.depth, dc.cap_left.get(f.tag, 0) - 1, room, spare)
        d = propose(lane.committed, k, c.spec.config)
        if not d:
            continue
        spare -= len(d)
        f.tokens.extend(d)
        drafts[f.tag] = d
    return drafts


def _fail_chunk(c: TickContext, st: TickState, dc: _Decode, chunk: list[_Round], e: PrimError, during: str) -> None:
    fail_step(c, st, [f.tag for f in chunk], e, during)
    for f in chunk:
        dc.remaining.pop(f.tag, None)


def _step_round(c: TickContext, st: TickState, dc: _Decode, rnd: list[_Round], drafts: dict[int, list[int]]) -> None:
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


def _penalized(c: TickContext, lane: Lane) -> bool:
    return c.pace.penalty_exempt is not None and hs.penalizes(lane.params)


def _own_row(c: TickContext, lane: Lane, row: np.ndarray) -> np.ndarray:
    """The row to pick from: a private copy when the grammar mask, bias or penalties will
    change it (a runtime's row may be a view of its batch), else the row itself --
    argmax, sampling and logprobs only read it."""
    if lane.grammar is not None or lane.bias is not None or _penalized(c, lane):
        return np.array(row, dtype=np.float32, copy=True)
    return row


def _process_row(c: TickContext, lane: Lane, row: np.ndarray) -> None:
    """Bias and penalties in place, in the reference's order (the grammar mask comes first)."""
    if lane.bias is not None:
        hs.apply_logit_bias(row, lane.bias)
    if _penalized(c, lane):
        hs.apply_penalties(row, lane.committed[-hs.PENALTY_WINDOW :], lane.params, c.pace.penalty_exempt)


def _pick(lane: Lane, row: np.ndarray) -> int:
    if _greedy(lane):
        return hs.argmax(row)
    return hs.sample(row, lane.params, hs.uniform(lane.rng_base + lane.rng_counter))


def _partial(st: TickState, tag: int, token: int) -> None:
    if st.plan.flags & TickFlag.PARTIAL_EMITS and st.on_partial_emit is not None:
        st.on_partial_emit(tag, token)


def _from_row(c: TickContext, st: TickState, dc: _Decode, tag: int, lane: Lane) -> int | None:
    """The token from the lane's row, in the reference's order: grammar mask, bias,
    penalties, then the pick (logprobs from the processed row). None: no token this
    round (a grammar fault, or a host lane whose row went out for the host to pick)."""
    row = _own_row(c, lane, st.rows.pop(tag))
    if lane.grammar is not None:
        try:
            lane.grammar.mask(row)
        except GrammarOverflow:
            dc.grammar_faults.append(tag)
            return None
    _process_row(c, lane, row)
    if lane.sampling == Sampling.HOST:
        # The host gets the row as far as this side's order goes (mask, bias,
        # penalties) and picks from it: the same pick gives the same token.
        dc.remaining.pop(tag, None)
        try:
            lane.pending_logits = c.rings.write_logits_row(row)
        except RingFull:
            dc.faults_oob.append(tag)
        return None
    token = _pick(lane, row)
    if lane.logprobs_top is not None:
        lp, top = hs.logprobs(row, token, min(lane.logprobs_top, MAX_TOP_LOGPROBS))
        st.logprobs.append(LaneLogprob(tag, token, lp, [i for i, _ in top], [v for _, v in top]))
    return token


def _sample_round(c: TickContext, st: TickState, dc: _Decode) -> list[_Round]:
    nxt: list[_Round] = []
    tags = sorted(set(st.rows) | set(dc.picked) | set(dc.spec_rows))
    for tag in tags:
        if tag in dc.spec_rows:
            _take_verified(c, st, dc, tag, nxt)
            continue
        lane = c.lanes[tag]
        if len(lane.committed) >= c.desc.max_seq_len:
            dc.picked.pop(tag, None)
            st.rows.pop(tag, None)
            _finish(lane, dc, tag, Finish.LENGTH)
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
        _partial(st, tag, token)
        dc.remaining[tag] -= 1
        lane.pending_input = token
        if not lane.params.flags & SamplingFlag.IGNORE_EOS and c.prim.is_eos(token):
            _finish(lane, dc, tag, Finish.EOS)
        elif grammar_done:
            _finish(lane, dc, tag, Finish.GRAMMAR)
        elif len(lane.committed) >= c.desc.max_seq_len:
            _finish(lane, dc, tag, Finish.LENGTH)
        elif dc.remaining[tag] == 0:
            dc.remaining.pop(tag)
        elif tag not in dc.grammar_faults:
            lane.pending_input = None
            nxt.append(_Round(tag, [token]))
    return nxt


def _finish(lane: Lane, dc: _Decode, tag: int, code: int) -> None:
    dc.finishes[tag] = code
    lane.finished = True
    dc.remaining.pop(tag, None)


def _take_verified(c: TickContext, st: TickState, dc: _Decode, tag: int, nxt: list[_Round]) -> None:
    """Sample each verified row as a plain decode would; drafts are taken while they
    match, and the first mismatch is the next token."""
    rows, draft = dc.spec_rows.pop(tag)
    lane = c.lanes[tag]
    kv_before = len(lane.committed) - 1  # the fed pending token was committed already
    taken = accepted = 0
    finish = None
    last = None
    ignore_eos = bool(lane.params.flags & SamplingFlag.IGNORE_EOS)
    for i, row in enumerate(rows):
        if len(lane.committed) >= c.desc.max_seq_len:
            finish = Finish.LENGTH
            break
        if dc.cap_left.get(tag, 0) == 0:
            break
        row = _own_row(c, lane, row)
        _process_row(c, lane, row)
        token = _pick(lane, row)
        lane.committed.append(token)
        lane.rng_counter += 1
        dc.cap_left[tag] -= 1
        taken += 1
        last = token
        dc.out[tag].append(token)
        _partial(st, tag, token)
        if tag in dc.remaining:
            dc.remaining[tag] = max(dc.remaining[tag] - 1, 0)
        if not ignore_eos and c.prim.is_eos(token):
            finish = Finish.EOS
            break
        if len(lane.committed) >= c.desc.max_seq_len:
            finish = Finish.LENGTH
            break
        if i < len(draft) and token == draft[i]:
            accepted += 1
        else:
            break
    lane.pending_input = last if taken else None
    lane.spec.record(c.spec.config, len(draft), accepted)
    stats = dc.spec_stats.setdefault(tag, [0, 0])
    stats[0] += len(draft)
    stats[1] += accepted
    if finish is not None:
        _finish(lane, dc, tag, finish)
    keep = kv_before + max(taken, 1)
    if keep < kv_before + 1 + len(draft):
        try:
            c.prim.seq_truncate(lane.seq, keep)
        except PrimError as e:
            fail_step(c, st, [tag], e, "a draft rollback")
            dc.remaining.pop(tag, None)
            return
    more = finish is None and dc.remaining.get(tag, 0) > 0 and dc.cap_left.get(tag, 0) > 0
    if more:
        nxt.append(_Round(tag, [lane.pending_input]))
        lane.pending_input = None
    else:
        dc.remaining.pop(tag, None)


def _emit(c: TickContext, st: TickState, dc: _Decode) -> None:
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
