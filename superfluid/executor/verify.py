"""Speculative rounds: drafts proposed per lane, and verified rows taken.

A drafted round feeds the pending token and the draft, gets every position's row,
and samples each verified row exactly as a plain decode would; drafts are taken while
they match, the first mismatch is the next token, and the sequence is cut back to
what was taken.
"""

from __future__ import annotations

from ..abi import Finish, SamplingFlag
from ..runtimes.base import PrimError
from .context import TickContext
from .faults import fail_step
from .rows import DecodeState, Round, finish, own_row, partial, pick, process_row
from .speculate import propose
from .tick_state import TickState


def draft(c: TickContext, rnd: list[Round], dc: DecodeState) -> dict[int, list[int]]:
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


def take_verified(c: TickContext, st: TickState, dc: DecodeState, tag: int, nxt: list[Round]) -> None:
    """Sample each verified row as a plain decode would; drafts are taken while they
    match, and the first mismatch is the next token."""
    rows, draft = dc.spec_rows.pop(tag)
    lane = c.lanes[tag]
    kv_before = len(lane.committed) - 1  # the fed pending token was committed already
    taken = accepted = 0
    end = None
    last = None
    ignore_eos = bool(lane.params.flags & SamplingFlag.IGNORE_EOS)
    for i, row in enumerate(rows):
        if len(lane.committed) >= c.desc.max_seq_len:
            end = Finish.LENGTH
            break
        if dc.cap_left.get(tag, 0) == 0:
            break
        row = own_row(c, lane, row)
        process_row(c, lane, row)
        token = pick(lane, row)
        lane.committed.append(token)
        lane.rng_counter += 1
        dc.cap_left[tag] -= 1
        taken += 1
        last = token
        dc.out[tag].append(token)
        partial(st, tag, token)
        if tag in dc.remaining:
            dc.remaining[tag] = max(dc.remaining[tag] - 1, 0)
        if not ignore_eos and c.prim.is_eos(token):
            end = Finish.EOS
            break
        if len(lane.committed) >= c.desc.max_seq_len:
            end = Finish.LENGTH
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
    if end is not None:
        finish(lane, dc, tag, end)
    keep = kv_before + max(taken, 1)
    if keep < kv_before + 1 + len(draft):
        try:
            c.prim.seq_truncate(lane.seq, keep)
        except PrimError as e:
            fail_step(c, st, [tag], e, "a draft rollback")
            dc.remaining.pop(tag, None)
            return
    more = end is None and dc.remaining.get(tag, 0) > 0 and dc.cap_left.get(tag, 0) > 0
    if more:
        nxt.append(Round(tag, [lane.pending_input]))
        lane.pending_input = None
    else:
        dc.remaining.pop(tag, None)
