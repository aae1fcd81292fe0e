"""The first half of a tick: check the whole plan, change nothing.

Every check reads executor and runtime state and raises ``Reject(status)``; nothing
here may mutate either (the grammar store's ``cursor`` builds a fresh matcher).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..abi import LaneAdmit, Sampling, Status, TickFlag, TickPlan
from ..rings import RingError
from .context import TickContext


class Reject(Exception):
    def __init__(self, status: Status):
        super().__init__(status.name)
        self.status = status


def ring_status(e: RingError) -> Status:
    if e.kind == RingError.Kind.STALE:
        return Status.REJECT_BAD_REF_GENERATION
    return Status.REJECT_BOUNDS


@dataclass
class Checked:
    """What validation learned, for the capacity check and the carry-out."""

    prompts: dict[int, list[int]] = field(default_factory=dict)  # admits' prompts
    cursors: dict[int, object] = field(default_factory=dict)  # admits' grammar cursors
    admits: dict[int, LaneAdmit] = field(default_factory=dict)
    # Per lane, for a block-exact capacity check: tokens its sequence holds now (a lease's
    # copy for an admit) and tokens this tick adds (prefill take + decode rounds).
    held: dict[int, int] = field(default_factory=dict)
    adds: dict[int, int] = field(default_factory=dict)
    live_retires: list = field(default_factory=list)


def prefill_end_of(prompt_len: int, leased: int, decode_replay: int) -> int:
    return max(prompt_len - decode_replay, leased)


def validate(c: TickContext, plan: TickPlan) -> Checked:
    desc = c.desc
    if c.last_plan_seq is not None and plan.plan_seq <= c.last_plan_seq:
        raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
    if plan.max_decode_lanes > desc.max_batch:
        raise Reject(Status.REJECT_BUDGET)
    if plan.flags & TickFlag.DRAIN and plan.admits:
        raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
    chk = Checked()
    _check_admits(c, plan, chk)
    _check_commits(c, plan)
    reached = _check_prefills(c, plan, chk)
    _check_decodes(c, plan, chk, reached)
    for r in plan.retires:
        if r.lane_tag not in c.lanes and r.lane_tag not in c.faulted:
            raise Reject(Status.REJECT_UNKNOWN_LANE)
    chk.live_retires = [r for r in plan.retires if r.lane_tag in c.lanes]
    retiring = {r.lane_tag for r in plan.retires}
    if len(retiring) != len(plan.retires):
        raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
    # Retires run first: a lane that goes cannot also be fed this tick.
    worked = {cm.lane_tag for cm in plan.commits} | {p.lane_tag for p in plan.prefills} | {d.lane_tag for d in plan.decodes}
    if retiring & worked:
        raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
    return chk


def _check_admits(c: TickContext, plan: TickPlan, chk: Checked) -> None:
    desc = c.desc
    seen_leases: set[int] = set()
    seen_grammars: set[int] = set()
    for a in plan.admits:
        if a.lane_tag in c.lanes or a.lane_tag in chk.admits or a.lane_tag == 0:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        try:
            prompt = c.rings.read_tokens(a.prompt)
        except RingError as e:
            raise Reject(ring_status(e)) from None
        if not prompt:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if max(prompt) >= desc.vocab_size:
            raise Reject(Status.REJECT_BOUNDS)
        if a.sampling not in (Sampling.GREEDY, Sampling.SAMPLE, Sampling.HOST):
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if a.decode_replay < 0 or a.decode_replay >= len(prompt):
            raise Reject(Status.REJECT_BOUNDS)
        if a.strategy_slot != 0 and (c.spec.config is None or c.spec.slot != a.strategy_slot):
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if a.grammar_handle != 0:
            if (
                not c.grammars.store.available(a.grammar_handle)
                or a.grammar_handle in seen_grammars
                or a.grammar_replay > len(prompt)
            ):
                raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
            seen_grammars.add(a.grammar_handle)
            replay = prompt[len(prompt) - a.grammar_replay :] if a.grammar_replay else []
            cursor = c.grammars.store.cursor(a.grammar_handle, replay)
            if cursor is None:
                raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
            chk.cursors[a.lane_tag] = cursor
        elif a.grammar_replay != 0:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if a.logit_bias_handle != 0 and a.logit_bias_handle not in c.biases:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if a.token_rules_handle != 0 and a.token_rules_handle not in c.rules:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if a.lease_handle != 0:
            _check_lease(c, a, prompt, seen_leases)
        if len(prompt) > desc.max_seq_len:
            raise Reject(Status.REJECT_BUDGET)
        chk.prompts[a.lane_tag] = prompt
        chk.admits[a.lane_tag] = a


def _check_lease(c: TickContext, a: LaneAdmit, prompt: list[int], seen: set[int]) -> None:
    if a.lease_handle in seen:
        raise Reject(Status.REJECT_STALE_LEASE)
    seen.add(a.lease_handle)
    lease = c.leases.live.get(a.lease_handle)
    if lease is None or lease.expires_at_tick < c.tick_count or lease.determinism != a.determinism_class:
        raise Reject(Status.REJECT_STALE_LEASE)
    n = len(lease.prefix)
    if len(prompt) < n or prompt[:n] != lease.prefix:
        raise Reject(Status.REJECT_STALE_LEASE)
    if lease.adopted is not None:
        if lease.adopted not in c.leases.bare:
            raise Reject(Status.REJECT_STALE_LEASE)
        if n == len(prompt) and c.desc.exact_only:
            # the state cannot give back the prompt's last token for the first decode
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
    elif c.pool.cache.get(lease.entry_id) is None:
        raise Reject(Status.REJECT_STALE_LEASE)


def _check_commits(c: TickContext, plan: TickPlan) -> None:
    seen: set[int] = set()
    for cm in plan.commits:
        lane = c.lanes.get(cm.lane_tag)
        if lane is None:
            raise Reject(Status.REJECT_UNKNOWN_LANE)
        if lane.sampling != Sampling.HOST or lane.finished or cm.lane_tag in seen:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        seen.add(cm.lane_tag)
        if lane.pending_logits is None:
            raise Reject(Status.REJECT_HOST_RULES)
        if cm.logits_nonce != lane.pending_logits.generation:
            raise Reject(Status.REJECT_STALE_NONCE)
        if not 0 <= cm.token_id < c.desc.vocab_size:
            raise Reject(Status.REJECT_BOUNDS)
        # A host lane with a grammar was sent a masked row: a token the mask ruled out
        # is the host breaking the rules (``allowed`` reads the cursor, it moves nothing).
        if lane.grammar is not None and not lane.grammar.cursor.allowed()[cm.token_id]:
            raise Reject(Status.REJECT_HOST_RULES)


def _leased(c: TickContext, a: LaneAdmit) -> int:
    return len(c.leases.live[a.lease_handle].prefix) if a.lease_handle else 0


def _check_prefills(c: TickContext, plan: TickPlan, chk: Checked) -> dict[int, int]:
    """Returns each prefilled lane's progress after this tick's budget."""
    reached: dict[int, int] = {}
    budget_left = plan.prefill_token_budget
    for p in plan.prefills:
        if p.lane_tag in reached:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        lane = c.lanes.get(p.lane_tag)
        if lane is not None:
            end, done = lane.prefill_end, lane.prefilled
        elif p.lane_tag in chk.admits:
            a = chk.admits[p.lane_tag]
            done = _leased(c, a)
            end = prefill_end_of(len(chk.prompts[p.lane_tag]), done, a.decode_replay)
        else:
            raise Reject(Status.REJECT_UNKNOWN_LANE)
        if p.token_offset != done or p.token_count < 0:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if p.token_offset + p.token_count > end:
            raise Reject(Status.REJECT_BOUNDS)
        take = min(p.token_count, budget_left)
        budget_left -= take
        chk.adds[p.lane_tag] = chk.adds.get(p.lane_tag, 0) + take
        if lane is not None:
            chk.held[p.lane_tag] = lane.ingested()
        reached[p.lane_tag] = done + take
    return reached


def _check_decodes(c: TickContext, plan: TickPlan, chk: Checked, reached: dict[int, int]) -> None:
    commits = {cm.lane_tag for cm in plan.commits}
    seen: set[int] = set()
    for d in plan.decodes:
        if d.lane_tag in seen or d.max_new_tokens < 0 or d.overshoot < 0:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        seen.add(d.lane_tag)
        lane = c.lanes.get(d.lane_tag)
        if lane is not None:
            is_host = lane.sampling == Sampling.HOST
            pending_row = lane.pending_logits is not None
            end = lane.prefill_end
            after = reached.get(d.lane_tag, lane.prefilled)
            finished, committed_len = lane.finished, len(lane.committed)
            replay_left = max(len(lane.prompt) - max(committed_len, end), 0)
        elif d.lane_tag in chk.admits:
            a = chk.admits[d.lane_tag]
            leased = _leased(c, a)
            end = prefill_end_of(len(chk.prompts[d.lane_tag]), leased, a.decode_replay)
            is_host, pending_row, finished = a.sampling == Sampling.HOST, False, False
            after, committed_len = reached.get(d.lane_tag, leased), end
            replay_left = len(chk.prompts[d.lane_tag]) - end
        else:
            raise Reject(Status.REJECT_UNKNOWN_LANE)
        if finished:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        if is_host:
            # One row per tick, after whatever the lane still replays (a rebuilt host
            # lane replays its committed tokens first). A grant past the replay's end
            # stops at the row: the scheduler cannot see how far a yield cut a replay.
            if d.max_new_tokens < 1 or (replay_left == 0 and d.max_new_tokens != 1):
                raise Reject(Status.REJECT_HOST_RULES)
            if pending_row and d.lane_tag not in commits:
                raise Reject(Status.REJECT_HOST_RULES)
        if after != end:
            raise Reject(Status.REJECT_ILLEGAL_COMBINATION)
        room = max(c.desc.max_seq_len - committed_len, 0)
        rounds = min(d.max_new_tokens, room)
        chk.adds[d.lane_tag] = chk.adds.get(d.lane_tag, 0) + rounds
        if lane is not None:
            chk.held[d.lane_tag] = lane.ingested()
