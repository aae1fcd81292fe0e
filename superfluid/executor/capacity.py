"""The capacity check: does the plan fit the pool, and what must leave it if not.

Cells needed = prefill tokens + decode rounds + leased copies (on runtimes whose copies
do not share cells) + one cell per publishing retire that still holds a pending token,
less what take-overs cut back. Against: free cells plus what non-publishing retires
release. If short, unpinned cache entries leave the pool (LRU, within the plan's
eviction limits); if still short, leases take their entries over instead of copying;
else NEEDS_REPLAN. Nothing changes here: the carry-out acts on the answer (a ``Fit``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..abi import CacheClass, LaneAdmit, Status, TickPlan
from ..pages import cells_added, cells_for
from .cache import CacheEntry
from .context import TickContext
from .validate import Checked, Reject


@dataclass
class Fit:
    """How the plan fits: who takes an entry over, and which entries leave the pool."""

    taken_over: set[int] = field(default_factory=set)  # lease handles whose entry a lane takes over
    victims: list[CacheEntry] = field(default_factory=list)


class _Leased:
    """The plan's leased admits as the check sees them."""

    def __init__(self, c: TickContext, plan: TickPlan, chk: Checked):
        self.c, self.chk = c, chk
        self.admits = [a for a in plan.admits if a.lease_handle]

    def keep(self, a: LaneAdmit) -> int:
        """Tokens the lane starts with: the lease's prefix, less the held-back last
        prompt token when it covers the whole prompt."""
        n = len(self.c.leases.live[a.lease_handle].prefix)
        return n - 1 if n == len(self.chk.prompts[a.lane_tag]) else n

    def entry(self, a: LaneAdmit) -> CacheEntry | None:
        lease = self.c.leases.live[a.lease_handle]
        return None if lease.adopted is not None else self.c.pool.cache.get(lease.entry_id)

    def takeover(self, a: LaneAdmit) -> int | None:
        """Cells cut back if this admit takes its entry over; None if it cannot."""
        desc = self.c.desc
        e = self.entry(a)
        if e is None or desc.copy_shares_cells or e.pins != 1 or e.seq is None:
            return None
        cuttable = desc.truncate_partial or len(e.tokens) == self.keep(a)
        # On a recurrent runtime a reused entry is kept for the next lease.
        shared = e.shared or (desc.exact_only and e.leased > 0)
        if not cuttable or shared:
            return None
        return max(len(e.tokens) - self.keep(a), 0)


def check_capacity(c: TickContext, plan: TickPlan, chk: Checked) -> Fit:
    leased = _Leased(c, plan, chk)
    page = 1 if c.desc.exact_only else c.pool.page
    fit = Fit()
    cut_back = _preferred_takeovers(c, leased, fit, page)
    needed = max(_cells_needed(c, leased, fit, page) - cut_back, 0)
    room = _Room(c, plan, chk)
    short_slots = _short_slots(c, plan, fit, len(room.retired))
    victims = room.victims(needed, short_slots)
    if victims is None:
        relief = more = 0
        for a in leased.admits:
            if a.lease_handle in fit.taken_over:
                continue
            back = leased.takeover(a)
            if back is None:
                continue
            relief += leased.keep(a) + back
            more += 1
            fit.taken_over.add(a.lease_handle)
        if more == 0:
            raise Reject(Status.NEEDS_REPLAN)
        victims = room.victims(max(needed - relief, 0), max(short_slots - more, 0))
        if victims is None:
            raise Reject(Status.NEEDS_REPLAN)
    fit.victims = victims
    return fit


def _preferred_takeovers(c: TickContext, leased: _Leased, fit: Fit, page: int) -> int:
    """On a runtime that prefers take-overs, a lease that keeps the whole previous
    prompt (the next turn) takes the entry over; a fork copies and leaves it for its
    siblings. Returns the cells cut back."""
    cut_back = 0
    if not c.desc.takeover_preferred:
        return 0
    for a in leased.admits:
        e = leased.entry(a)
        if e is None or leased.keep(a) < e.prompt // page * page:
            continue
        back = leased.takeover(a)
        if back is not None and back <= leased.keep(a):
            fit.taken_over.add(a.lease_handle)
            cut_back += back
    return cut_back


def _cells_needed(c: TickContext, leased: _Leased, fit: Fit, page: int) -> int:
    """Cells the plan's copies, imports, prefills, decodes and publishing retires take.

    A copy costs its cells where copies do not share them. An entry out of the pool
    comes in whole and is cut to the lease, so the plan's peak is the larger of the
    import's excess and the prefills' and decodes' needs."""
    chk = leased.chk
    copies = import_excess = 0
    for a in leased.admits:
        e = leased.entry(a)
        if e is None or a.lease_handle in fit.taken_over:
            continue
        keep = leased.keep(a)
        if e.seq is None:
            copies += cells_for(keep, page)
            import_excess = max(import_excess, len(e.tokens) - keep)
        elif not c.desc.copy_shares_cells:
            copies += cells_for(keep, page)
        elif keep % page:
            copies += page  # a sharing copy copies only its partial last page
    # Prefills and decodes in whole blocks: a lane holding h tokens that adds n takes
    # the pages of h + n less the pages of h (a leased admit holds its lease).
    work = 0
    for tag, n in chk.adds.items():
        a = chk.admits.get(tag)
        if tag in chk.held:
            h = chk.held[tag]
        elif a is not None and a.lease_handle:
            h = leased.keep(a)
        else:
            h = 0
        work += cells_added(h, n, page)
    publishing = sum(
        1 for r in chk.live_retires if r.publish_to_cache and c.lanes[r.lane_tag].pending_input is not None
    )
    return copies + max(work, import_excess) + publishing


def _short_slots(c: TickContext, plan: TickPlan, fit: Fit, retired: int) -> int:
    """Sequence slots the admits lack (0 on a runtime without a slot limit)."""
    if c.desc.max_seqs <= 0:
        return 0
    needed = sum(
        1
        for a in plan.admits
        if not a.lease_handle
        or (c.leases.live[a.lease_handle].adopted is None and a.lease_handle not in fit.taken_over)
    )
    free = max(c.desc.max_seqs + retired - c.live_sequences(), 0)
    return max(needed - free, 0)


class _Room:
    """Free cells, what retires release, and the entries that may leave for more.

    The quota keeps that many bytes of cache resident (the reference's rule), and the
    keyed entries within it are the ones kept. Except when no lane would be left to
    finish and make room: then a single request that fits only without them gets it."""

    def __init__(self, c: TickContext, plan: TickPlan, chk: Checked):
        self.c, self.plan = c, plan
        self.retired = [c.lanes[r.lane_tag].seq for r in chk.live_retires if not r.publish_to_cache]
        mem = c.prim.mem_counters()
        self.unlimited = mem.cells_total == 0
        self.free = max(mem.cells_total - mem.cells_used, 0)
        cache = c.pool.cache
        self.protected = cache.protected(plan.protected_quota_bytes)
        self.lone = len(c.lanes) - len(chk.live_retires) == 0 and len(plan.admits) <= 1
        self.quota_limit = min(plan.max_evict_bytes, max(cache.resident_bytes() - plan.protected_quota_bytes, 0))

    def fits(self, need: int, seqs: list[int]) -> bool:
        return self.unlimited or self.free + self.c.prim.cells_released(seqs) >= need

    def victims(self, need: int, short: int) -> list[CacheEntry] | None:
        """The entries to leave the pool so that ``need`` cells and ``short`` slots fit;
        None if no choice within the plan's limits does."""
        if self.fits(need, self.retired) and short == 0:
            return []
        if not self.plan.evictable_cache_classes & CacheClass.RESIDENT_PREFIX:
            return None
        tries = [(self.quota_limit, self.protected)]
        if self.lone and self.plan.protected_quota_bytes:
            tries.append((self.plan.max_evict_bytes, frozenset()))
        for limit, kept in tries:
            picked, enough = self.c.pool.cache.plan_evict_until(
                limit,
                lambda picked: len(picked) >= short and self.fits(need, self.retired + [e.seq for e in picked]),
                kept,
            )
            if enough:
                return picked
        return None
