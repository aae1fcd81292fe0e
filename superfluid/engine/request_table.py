"""The scheduler's requests — waiting, running and orphaned lanes — and the one place
their lifecycle (lifecycle.py) changes: ``RequestTable.apply``.

Every change is a record (``Queued``, ``TickApplied``, ``Preempted``, ``Ended``,
``Settled``, ``Detached``, ``LanesLost``, ``Withdrawn``) applied through an operations
table, so what can happen to a request is the list of these records.

Invariants:
- ``waiting`` holds exactly the QUEUED requests, in priority order (FCFS among equals);
  ``running`` maps every lane tag a request holds to it (LIVE, ENDING or RETIRING); the
  next plan retires the lanes of ENDING and RETIRING ones (a lane may go before its
  request's end settles: the executor copied what it needs of the handles).
- ``orphans`` are lanes no request holds any more (preempted ones, handed-over ones):
  the next tick retires them, and what they give back is ``orphan_cells``.
- An end goes in two moves: ``Ended`` (a verdict: the request takes no more tokens and
  keeps its handles, so nothing is released while a tick may run) and ``Settled``
  (between ticks: handles go, the lane retires next tick). The first verdict wins.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import abi
from ..pages import cells_for
from . import cache_keys
from .config import SchedulerConfig
from .lifecycle import LIVE, QUEUED, RETIRES, Phase, check
from .outputs import ErrorCode
from .planner import Admission, ScheduledTick
from .priority import PriorityPolicy
from .request import FinishReason, Request
from .updates import GRAMMAR_DEAD_END, SchedulerStats


@dataclass(frozen=True, eq=False)
class Queued:
    request: Request


@dataclass(frozen=True, eq=False)
class Withdrawn:
    """A submission undone part-way: the request leaves the queue as if never queued."""

    request: Request


@dataclass(frozen=True, eq=False)
class TickApplied:
    """The executor accepted ``tick`` and answered with ``events``."""

    tick: ScheduledTick
    events: abi.TickEvents


@dataclass(frozen=True, eq=False)
class Preempted:
    """The lane gives way (retired unpublished in the next plan); the request is
    re-admitted later with its tokens replayed, to the same text."""

    request: Request


@dataclass(frozen=True, eq=False)
class Ended:
    request: Request
    reason: FinishReason
    error: str | None = None
    code: ErrorCode | None = None  # with an error: its code


@dataclass(frozen=True)
class Settled:
    """Between ticks: every ENDING request finishes."""


@dataclass(frozen=True, eq=False)
class Detached:
    """The request leaves unfinished (handed over): its lane retires *publishing* its KV."""

    request: Request


@dataclass(frozen=True)
class LanesLost:
    """The executor was replaced by a clean one: every lane is gone, no request is."""


class RequestTable:
    def __init__(self, config: SchedulerConfig, desc, policy: PriorityPolicy, stats: SchedulerStats):
        self.config, self.desc, self.policy, self.stats = config, desc, policy, stats
        self.waiting: list[Request] = []
        self.running: dict[int, Request] = {}  # lane tag -> request, admission order
        self.orphans: list[abi.LaneRetire] = []
        self.orphan_cells = 0
        self.ending: list[Request] = []  # the ENDING requests, in the order they ended
        self._ops = {
            Queued: self._queued, Withdrawn: self._withdrawn, TickApplied: self._tick_applied,
            Preempted: self._preempted, Ended: self._ended, Settled: self._settled,
            Detached: self._detached, LanesLost: self._lanes_lost,
        }

    def apply(self, change) -> list[Request]:
        """Apply one change; returns the requests it settled (whose end may go out now)."""
        return self._ops[type(change)](change) or []

    # ------------------------------------------------------------ reads
    def live(self) -> list[Request]:
        """Running lanes that go on (not ending or retiring), admission order."""
        return [r for r in self.running.values() if r.phase in LIVE]

    def retiring(self) -> bool:
        """Some lane's request has ended: the next plan retires it."""
        return any(r.phase in RETIRES for r in self.running.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.orphans or self.ending)

    # ------------------------------------------------------------ moves
    def _move(self, req: Request, phase: Phase) -> None:
        check(req.phase, phase)
        req.phase = phase

    def _queued(self, c: Queued) -> None:
        req = c.request
        self._move(req, Phase.PREEMPTED if req.admitted_once else Phase.WAITING)
        self.waiting.append(req)
        self.policy.order(self.waiting)

    def _withdrawn(self, c: Withdrawn) -> None:
        if c.request in self.waiting:
            self.waiting.remove(c.request)

    def _requeue(self, req: Request) -> None:
        """A request that lost its lane goes back to the queue, to be re-admitted with its
        history (any host row out is void: the new lane sends it again)."""
        req.lane_tag = None
        req.prefilled = 0
        req.replay_pending = False
        req.host_row_out, req.host_commit = False, None
        self._move(req, Phase.PREEMPTED)
        self.waiting.append(req)
        self.policy.order(self.waiting)

    def _preempted(self, c: Preempted) -> None:
        req = c.request
        self.running.pop(req.lane_tag, None)
        self.orphan_cells += cells_for(req.held_tokens(), self.desc.page)
        # Not published: the point is to give its cells back in this very plan.
        self.orphans.append(abi.LaneRetire(req.lane_tag, publish_to_cache=False))
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self._requeue(req)

    def _ended(self, c: Ended) -> None:
        req = c.request
        if not req.takes_tokens:
            return  # the first verdict stands
        if req.phase in QUEUED:
            self.waiting.remove(req)
        self._move(req, Phase.ENDING)
        req.finish_reason, req.error, req.error_code = c.reason, c.error, c.code
        self.ending.append(req)

    def _settled(self, c: Settled) -> list[Request]:
        settled, self.ending = self.ending, []
        for req in settled:
            req.handles.release()  # the one place a request's handles go
            req.host_row_out, req.host_commit = False, None
            self._move(req, Phase.RETIRING if req.lane_tag is not None else Phase.FINISHED)
        return settled

    def _detached(self, c: Detached) -> None:
        req = c.request
        if req.lane_tag is not None and self.running.pop(req.lane_tag, None) is not None:
            self.orphans.append(abi.LaneRetire(req.lane_tag, publish_to_cache=True))
        req.lane_tag = None
        self._ended(Ended(req, FinishReason.ABORT, "handed over"))

    def _lanes_lost(self, c: LanesLost) -> None:
        running, self.running = list(self.running.values()), {}
        self.orphans, self.orphan_cells = [], 0
        for req in running:
            if req.phase in LIVE:
                self._requeue(req)
                continue
            req.lane_tag = None
            if req.phase is Phase.RETIRING:
                self._move(req, Phase.FINISHED)

    # ------------------------------------------------------------ an accepted tick
    def _tick_applied(self, c: TickApplied) -> None:
        """Retires done, host commits taken, admissions, prefill progress less shed
        chunks, faults, prompt scores, which lanes emitted."""
        tick, events = c.tick, c.events
        self.stats.ticks += 1
        self.orphans, self.orphan_cells = [], 0
        for tag in tick.retires:
            req = self.running.pop(tag, None)
            if req is not None:
                req.lane_tag = None
                if req.phase is Phase.RETIRING:
                    self._move(req, Phase.FINISHED)  # an ENDING one finishes when it settles
        for commit in tick.plan.commits:
            req = self.running.get(commit.lane_tag)
            if req is not None and req.host_commit is commit:
                req.host_commit = None
        for adm in tick.admissions:
            self._admitted(adm)
        self._prefilled(tick, events.shed)
        self._faults(events.faults)
        for plp in events.prompt_logprobs:
            req = self.running.get(plp.lane_tag)
            if req is not None:
                req.prompt_scores[plp.position] = plp
        for emit in events.emits:
            req = self.running.get(emit.lane_tag)
            if emit.spec.proposed:
                self.stats.spec_proposed += emit.spec.proposed
                self.stats.spec_accepted += emit.spec.accepted
            self.stats.generation_tokens += emit.n_tokens
            if req is not None and (emit.n_tokens or emit.logits_row.length):
                req.replay_pending = False

    def _admitted(self, adm: Admission) -> None:
        """The request now holds its lane, prefilled as far as its lease reaches. One that
        ended within this very tick (a streamed token ended it) keeps its verdict: its
        lane retires once the end settles."""
        req = adm.request
        self._count_admission(adm)
        if req in self.waiting:
            self.waiting.remove(req)
        req.lane_tag = adm.lane_tag
        self.running[adm.lane_tag] = req
        if req.phase is Phase.ENDING:
            return
        req.prefilled = adm.lease.prefix_len if adm.lease else 0
        req.prefill_end = adm.prefill_end
        req.replay = adm.replay
        req.replay_pending = adm.replay > 0
        self._move(req, Phase.PREFILLING)

    def _prefilled(self, tick: ScheduledTick, shed: abi.ShedReport) -> None:
        """Lanes advance by the chunks planned, less what the executor shed of them; one
        whose history is all in goes on to decode."""
        dropped: dict[int, int] = {}
        for e in shed.entries:
            if e.kind == abi.ShedKind.PREFILL_CHUNK:
                dropped[e.lane_tag] = dropped.get(e.lane_tag, 0) + e.tokens
        for tag, n in tick.prefills.items():
            req = self.running.get(tag)
            if req is not None:
                req.prefilled += n - dropped.get(tag, 0)
        for tag in {*tick.prefills, *(a.lane_tag for a in tick.admissions)}:  # the lanes this tick moved
            req = self.running.get(tag)
            if req is not None and req.phase is Phase.PREFILLING and req.prefill_done:
                self._move(req, Phase.DECODING)

    def _faults(self, faults: list[abi.LaneFault]) -> None:
        """A faulted lane is gone; its request is retried (a tentative OOM, a few times)
        or ends with an error, alone."""
        for f in faults:
            req = self.running.pop(f.lane_tag, None)
            if req is None:
                continue
            req.lane_tag = None  # the executor dropped the lane: nothing to retire
            if not req.takes_tokens:
                continue
            if f.code == abi.FaultCode.OOM_TENTATIVE and req.num_oom_retries < self.config.max_oom_retries:
                req.num_oom_retries += 1
                self._requeue(req)
            elif f.code == abi.FaultCode.GRAMMAR_OVERFLOW:  # the request's own grammar, not the server
                self._ended(Ended(req, FinishReason.ERROR, GRAMMAR_DEAD_END, ErrorCode.GRAMMAR_DEAD_END))
            else:
                name = abi.FaultCode(f.code).name if f.code in abi.FaultCode._value2member_map_ else str(f.code)
                self._ended(Ended(req, FinishReason.ERROR, f"the lane failed ({name})", ErrorCode.LANE_FAULT))

    def _count_admission(self, adm: Admission) -> None:
        req = adm.request
        self.stats.prefix_hit_tokens += adm.lease.prefix_len if adm.lease else 0
        if not req.admitted_once:
            req.admitted_once = True
            req.cached_tokens = min(adm.lease.prefix_len if adm.lease else 0, len(req.prompt_token_ids))
            if req.cached_tokens:
                cache_keys.count_hit(self.stats.cache_hits, req.cache_retention)
            self.stats.prompt_tokens += len(req.prompt_token_ids)
