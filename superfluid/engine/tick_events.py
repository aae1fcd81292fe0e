"""Applying an accepted tick's events to the requests: admissions, prefill progress
less shed chunks, faults, prompt scores, emits (tokens, host rows, finishes), memory.

A mixin of the Scheduler (its second half): it reads and changes the scheduler's
request tables (``running``, ``waiting``), its stats and its memory estimates, and
ends requests through ``finish`` (deferred to the tick's end while one runs).
"""

from __future__ import annotations

from .. import abi
from . import cache_keys
from .planner import Admission, ScheduledTick
from .request import FinishReason, Request, Status
from .updates import GRAMMAR_DEAD_END, RequestUpdate, update_of

_FINISH = {abi.Finish.EOS: FinishReason.STOP, abi.Finish.LENGTH: FinishReason.LENGTH, abi.Finish.GRAMMAR: FinishReason.STOP}


class EventsApplied:
    def update(self, tick: ScheduledTick, events: abi.TickEvents, updates: dict[int, RequestUpdate] | None = None,
               tokens_streamed: bool = False) -> list[RequestUpdate]:
        """Apply an accepted tick's events. Usable with hand-made events in tests.
        ``tokens_streamed``: the tick's tokens came as partial emits, so the events'
        tokens are not taken again (only counted)."""
        self.stats.ticks += 1
        self._orphans = []
        self._orphan_cells = 0
        for tag in tick.retires:
            self.running.pop(tag, None)
        for c in tick.plan.commits:
            req = self.running.get(c.lane_tag)
            if req is not None and req.host_commit is c:
                req.host_commit = None
        for adm in tick.admissions:
            self._apply_admission(adm)
        self._apply_prefills(tick, events.shed)
        updates = {} if updates is None else updates  # id(request) -> its update, first event first
        self._apply_faults(events.faults, updates)
        for plp in events.prompt_logprobs:
            req = self.running.get(plp.lane_tag)
            if req is not None:
                req.prompt_scores[plp.position] = plp
        logprobs: dict[int, list[abi.LaneLogprob]] = {}
        for lp in events.logprobs:
            logprobs.setdefault(lp.lane_tag, []).append(lp)
        for emit in events.emits:
            req = self.running.get(emit.lane_tag)
            if req is not None:
                self._apply_emit(req, emit, [] if tokens_streamed else logprobs.get(emit.lane_tag, []), tokens_streamed, updates)
        self._note_memory(events.mem)
        return list(updates.values())

    def _apply_admission(self, adm: Admission) -> None:
        """The request now holds its lane, prefilled as far as its lease reaches."""
        req = adm.request
        self._count_admission(adm)
        self.stats.prefix_hit_tokens += adm.lease.prefix_len if adm.lease else 0
        if req in self.waiting:
            self.waiting.remove(req)
        req.lane_tag = adm.lane_tag
        self.running[adm.lane_tag] = req
        if req.is_finished:
            # It finished within this very tick (a partial emit hit max_tokens or a
            # stop string before the admission was applied): its lane still retires.
            req.retire_pending = True
            return
        req.status = Status.RUNNING
        req.prefilled = adm.lease.prefix_len if adm.lease else 0
        req.prefill_end = adm.prefill_end
        req.replay = adm.replay
        req.replay_pending = adm.replay > 0
        req.lane_finished = False
        req.retire_pending = False

    def _apply_prefills(self, tick: ScheduledTick, shed: abi.ShedReport) -> None:
        """Lanes advance by the chunks planned, less what the executor shed of them."""
        dropped: dict[int, int] = {}
        for e in shed.entries:
            if e.kind == abi.ShedKind.PREFILL_CHUNK:
                dropped[e.lane_tag] = dropped.get(e.lane_tag, 0) + e.tokens
        for tag, n in tick.prefills.items():
            req = self.running.get(tag)
            if req is not None:
                req.prefilled += n - dropped.get(tag, 0)

    def _apply_faults(self, faults: list[abi.LaneFault], updates: dict[int, RequestUpdate]) -> None:
        """A faulted lane is gone; its request is retried (a tentative OOM, a few
        times) or fails, alone."""
        for f in faults:
            req = self.running.pop(f.lane_tag, None)
            if req is None or req.done:
                continue
            req.lane_tag = None  # the executor dropped the lane: nothing to retire
            if f.code == abi.FaultCode.OOM_TENTATIVE and req.num_oom_retries < self.config.max_oom_retries:
                req.num_oom_retries += 1
                self._requeue(req)
                continue
            if f.code == abi.FaultCode.GRAMMAR_OVERFLOW:  # the request's own grammar, not the server
                self.finish(req, FinishReason.ERROR, GRAMMAR_DEAD_END)
            else:
                name = abi.FaultCode(f.code).name if f.code in abi.FaultCode._value2member_map_ else str(f.code)
                self.finish(req, FinishReason.ERROR, f"the lane failed ({name})")
            update_of(updates, req).finished = True

    def _apply_emit(
        self, req: Request, emit: abi.LaneEmit, lps: list[abi.LaneLogprob], tokens_streamed: bool,
        updates: dict[int, RequestUpdate],
    ) -> None:
        """One lane's emit: a host lane's row goes to its callbacks; its tokens arrive
        (unless they came as partial emits) until one ends the request; a finish ends it."""
        if emit.spec.proposed:
            self.stats.spec_proposed += emit.spec.proposed
            self.stats.spec_accepted += emit.spec.accepted
        if emit.logits_row.length and not req.done:
            # A host lane's row: copied now, before the next tick rewrites the ring.
            req.replay_pending = False
            self.host.submit(req, emit.lane_tag, emit.logits_row.generation, self.rings.read_logits_row(emit.logits_row))
        self.stats.generation_tokens += emit.n_tokens
        if emit.finish != abi.Finish.NONE:
            req.lane_finished = True
        if req.done:
            return  # it ended within this tick; the rest is discarded
        u = update_of(updates, req)
        tokens = [] if tokens_streamed or not emit.n_tokens else self.rings.read_emits(emit.token_ref)
        for i, token in enumerate(tokens):
            if not self._arrive(req, token):
                break
            u.new_token_ids.append(token)
            if i < len(lps):
                u.new_logprobs.append(lps[i])
        if not req.done and emit.finish != abi.Finish.NONE:
            self.finish(req, _FINISH.get(abi.Finish(emit.finish), FinishReason.STOP))
        u.finished = req.is_finished

    def _count_admission(self, adm: Admission) -> None:
        req = adm.request
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = min(adm.lease.prefix_len if adm.lease else 0, len(req.prompt_token_ids))
            if req.cached_tokens:
                cache_keys.count_hit(self.stats.cache_hits, req.cache_retention)
            self.stats.prompt_tokens += len(req.prompt_token_ids)

    def _note_memory(self, mem: abi.TickMemCounters) -> None:
        self.stats.kv_blocks_total = mem.pool_blocks_total
        self.stats.kv_blocks_used = mem.pool_blocks_used
        pool = mem.pool_blocks_total * self.desc.page * self.desc.cell_bytes
        self._protected_quota = cache_keys.note_classes(self.stats.cache_bytes, mem, pool, self.config.cache_protected_fraction)
        if mem.pool_blocks_total == 0:
            self._free_cells = None  # the runtime does not count cells: NeedsReplan decides
            return
        page = self.desc.page
        evictable = mem.pool_bytes_evictable // self.desc.cell_bytes if self.desc.cell_bytes else 0
        free = (mem.pool_blocks_total - mem.pool_blocks_used) * page + evictable
        self._free_cells = free - int(self.config.kv_watermark * mem.pool_blocks_total * page)
