"""The capacity check: does the plan fit the pool, and what must leave it if not.

Cells needed = prefill tokens + decode rounds + seeded copies (on runtimes whose copies
do not share cells) + one cell per publishing retire that still holds a pending token,
less what take-overs cut back. Against: free cells plus what non-publishing retires
release. If short, unpinned cache entries leave the pool (LRU, within the plan's
eviction limits); if still short, seeds take their entries over instead of copying;
else NEEDS_REPLAN. Nothing changes here: the carry-out acts on the answer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..abi import CacheClass, LaneAdmit, Status, TickPlan
from .cache import CacheEntry
from .validate import Checked, Reject

if TYPE_CHECKING:
    from .executor import Executor


@dataclass
class Capacity:
    taken_over: set[int] = field(default_factory=set)  # seed handles whose entry a lane takes over
    victims: list[CacheEntry] = field(default_factory=list)  # entries that leave the pool


def check_capacity(ex: "Executor", plan: TickPlan, chk: Checked) -> Capacity:
    desc = ex.desc
    seeded_admits = [a for a in plan.admits if a.seed_handle]
    retired = [ex.lanes[r.lane_tag].seq for r in chk.live_retires if not r.publish_to_cache]
    publishing = sum(
        1 for r in chk.live_retires if r.publish_to_cache and ex.lanes[r.lane_tag].pending_input is not None
    )

    def keep(a: LaneAdmit) -> int:
        n = len(ex.seeds[a.seed_handle].prefix)
        return n - 1 if n == len(chk.prompts[a.lane_tag]) else n

    def entry(a: LaneAdmit) -> CacheEntry | None:
        lease = ex.seeds[a.seed_handle]
        return None if lease.adopted is not None else ex.cache.get(lease.entry_id)

    def takeover(a: LaneAdmit) -> int | None:
        """Cells cut back if this admit takes its entry over; None if it cannot."""
        e = entry(a)
        if e is None or desc.copy_shares_cells or e.pins != 1 or e.seq is None:
            return None
        cuttable = desc.truncate_partial or len(e.tokens) == keep(a)
        # On a recurrent runtime a reused entry is kept for the next seed.
        shared = e.shared or (desc.exact_only and e.seeded > 0)
        if not cuttable or shared:
            return None
        return max(len(e.tokens) - keep(a), 0)

    cap = Capacity()
    cut_back = 0
    page = max(desc.page, 1) if not desc.exact_only else 1
    if desc.takeover_preferred:
        # Only a seed that keeps the whole previous prompt (the next turn) takes the
        # entry over; a fork copies and leaves it for its siblings.
        for a in seeded_admits:
            e = entry(a)
            if e is None or keep(a) < e.prompt // page * page:
                continue
            back = takeover(a)
            if back is not None and back <= keep(a):
                cap.taken_over.add(a.seed_handle)
                cut_back += back

    # A copy costs its cells where copies do not share them. An entry out of the pool
    # comes in whole and is cut to the seed, so the plan's peak is the larger of the
    # import's excess and the prefills' and decodes' needs.
    seeded = import_excess = 0
    for a in seeded_admits:
        e = entry(a)
        if e is None or a.seed_handle in cap.taken_over:
            continue
        # A paged copy takes whole pages; a sharing one copies only its partial last page.
        pages = -(-keep(a) // page) * page
        if e.seq is None:
            seeded += pages
            import_excess = max(import_excess, len(e.tokens) - keep(a))
        elif not desc.copy_shares_cells:
            seeded += pages
        elif keep(a) % page:
            seeded += page
    # Prefills and decodes in whole blocks: a lane holding h tokens that adds n takes
    # ceil((h + n) / page) - ceil(h / page) blocks (a seeded admit holds its seed).
    work = 0
    for tag, n in chk.adds.items():
        a = chk.admits.get(tag)
        if tag in chk.held:
            h = chk.held[tag]
        elif a is not None and a.seed_handle:
            h = keep(a)
        else:
            h = 0
        work += (-(-(h + n) // page) - -(-h // page)) * page
    needed = max(seeded + max(work, import_excess) + publishing - cut_back, 0)

    mem = ex.prim.mem_counters()
    free = max(mem.cells_total - mem.cells_used, 0)

    def cells_fit(need: int, victims: list[int]) -> bool:
        return mem.cells_total == 0 or free + ex.prim.cells_released(victims) >= need

    short_slots = 0
    if desc.max_seqs > 0:
        needed_slots = sum(
            1
            for a in plan.admits
            if not a.seed_handle
            or (ex.seeds[a.seed_handle].adopted is None and a.seed_handle not in cap.taken_over)
        )
        free_slots = max(desc.max_seqs + len(retired) - ex.live_sequences(), 0)
        short_slots = max(needed_slots - free_slots, 0)

    # The quota keeps that many bytes of cache resident (the reference's rule), and the
    # keyed entries within it are the ones kept. Except when no lane would be left to
    # finish and make room: then a single request that fits only without them gets it.
    protected = ex.cache.protected(plan.protected_quota_bytes)
    lone = len(ex.lanes) - len(chk.live_retires) == 0 and len(plan.admits) <= 1
    quota_limit = min(plan.max_evict_bytes, max(ex.cache.resident_bytes() - plan.protected_quota_bytes, 0))

    def room(need: int, short: int) -> list[CacheEntry] | None:
        if cells_fit(need, retired) and short == 0:
            return []
        if not plan.evictable_cache_classes & CacheClass.RESIDENT_PREFIX:
            return None
        tries = [(quota_limit, protected)]
        if lone and plan.protected_quota_bytes:
            tries.append((plan.max_evict_bytes, frozenset()))
        for limit, keep in tries:
            picked, enough = ex.cache.plan_evict_until(
                limit,
                lambda picked: len(picked) >= short and cells_fit(need, retired + [e.seq for e in picked]),
                keep,
            )
            if enough:
                return picked
        return None

    victims = room(needed, short_slots)
    if victims is None:
        relief = more = 0
        for a in seeded_admits:
            if a.seed_handle in cap.taken_over:
                continue
            back = takeover(a)
            if back is None:
                continue
            relief += keep(a) + back
            more += 1
            cap.taken_over.add(a.seed_handle)
        if more == 0:
            raise Reject(Status.NEEDS_REPLAN)
        victims = room(max(needed - relief, 0), max(short_slots - more, 0))
        if victims is None:
            raise Reject(Status.NEEDS_REPLAN)
    cap.victims = victims
    return cap
