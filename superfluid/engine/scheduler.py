"""Continuous batching over the tick contract.

One step reads in a few lines: build a plan from the requests (``Planner``), run
it (``Executor.run_tick``), apply the events (``update``, tick_events.py). A plan the executor
answers with ``NeedsReplan`` changed nothing, so the step rebuilds it tighter:
fewer admissions, then one decode round, then a preempted lane (retired without
publishing, re-admitted later with ``decode_replay``), and only when a single
request cannot fit alone does that request fail (pressure.py decides which). A step's
prefix leases are leasing.py's; which new request a failed step is blamed on,
isolation.py's.

Token-level finishing lives here (``_accept``): the executor's EOS / length /
grammar finishes, stop token ids and ``max_tokens``. Text-level finishing (stop
strings) is the engine's; it calls ``finish`` and the lane retires next tick.

Threading: every method runs on the engine's loop thread, except that another
thread may raise the rings' yield flag (``rings.request_yield``) to cut a running
tick short when a request arrives.
"""

from __future__ import annotations

import msgspec

from .. import abi
from ..pages import cells_for
from .config import SchedulerConfig
from .host_pick import HostPickError
from .host_sampling import HostSampler
from .isolation import FaultIsolation
from .leasing import StepLeases
from .planner import Limits, Planner, ScheduledTick, SchedulerView
from .pressure import NO_FIT, relieve
from .priority import PriorityPolicy
from .request import FinishReason, Request, Status
from .tick_events import EventsApplied
from .updates import RequestUpdate, SchedulerError, SchedulerStats, TokenCallback, update_of


class Scheduler(EventsApplied):
    def __init__(self, executor, rings, config: SchedulerConfig = SchedulerConfig(), eos_ids: frozenset[int] = frozenset()):
        self.ex = executor
        self.rings = rings
        self.config = config
        self.desc = executor.desc
        self.eos_ids = eos_ids  # a host-picked EOS ends its request here (the executor only sees commits)
        self.max_running = config.max_running or self.desc.max_batch
        self.policy = PriorityPolicy(config.scheduling_policy, config.priority_aging_s)
        self.planner = Planner(config, self.desc, self.max_running, self.policy)
        self.host = HostSampler(config.host_threads, config.host_grace_s)
        self.waiting: list[Request] = []  # priority order; FCFS among equals
        self.running: dict[int, Request] = {}  # lane tag -> request, admission order
        self._orphans: list[abi.LaneRetire] = []  # lanes of preempted requests, to retire
        self._orphan_cells = 0  # what retiring them gives back (estimate)
        self._free_cells: int | None = None
        self._failed: list[Request] = []  # failed while re-planning; reported by the step
        self._protected_quota = 0  # bytes of keyed cache entries the plans protect
        self._carried: list[RequestUpdate] = []  # host picks and tick-end finishes, reported by the step
        self._ticking = False  # a tick runs: finishes wait for its end (see finish)
        self._ending: list[Request] = []
        self.draining = False
        self.stats = SchedulerStats()
        self.isolation = FaultIsolation()

    # ------------------------------------------------------------ requests
    def add(self, req: Request, fresh: bool = False) -> None:
        """Queue a request; ``fresh``: newly submitted (it has never been in a tick)."""
        self.policy.key(req)  # a request whose place cannot be computed is refused before it queues
        if fresh:
            self.isolation.submitted(req)
        req.status = Status.WAITING
        self.waiting.append(req)
        self.policy.order(self.waiting)

    def forget(self, req: Request) -> None:
        """Take a request that never ran out of the queue (a submission that failed
        part-way is undone whole)."""
        if req in self.waiting:
            self.waiting.remove(req)
        self.isolation.forget(req)

    def isolate(self, error: BaseException) -> list[Request] | None:
        """A step raised ``error``: the new request it is blamed on finishes with the error
        (returned); [] when several suspects went on probation; None when no new request
        can be blamed (isolation.py)."""
        blamed = self.isolation.blame()
        for req in blamed or ():
            self.finish(req, FinishReason.ERROR, f"the request could not be run: {error!r}")
        return blamed

    def _admissible(self) -> list[Request]:
        """The waiting requests a plan may admit: those whose grammar is compiled, as
        fault isolation allows."""
        waiting = self.waiting
        if any(r.handles.grammar_pending for r in waiting):  # still compiling: not yet
            waiting = [r for r in waiting if not r.handles.grammar_pending]
        return self.isolation.admissible(waiting, self.waiting)

    def finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a request (stop string, abort), releasing its handles; a live lane
        retires at the next tick. While a tick runs (a token streamed from it ended the
        request) the request only stops taking tokens: it finishes when the tick is
        over, so requests finish between ticks only."""
        if self._ticking:
            if not req.done:
                req.ending = (reason, error)
                self._ending.append(req)
            return
        was_waiting = req.status is Status.WAITING
        req.finish(reason, error)
        if was_waiting and req in self.waiting:
            self.waiting.remove(req)

    def detach(self, req: Request) -> None:
        """The request leaves this engine unfinished (handed over): its lane, if any,
        retires at the next tick *publishing* its state to the cache."""
        if req.lane_tag is not None and self.running.pop(req.lane_tag, None) is not None:
            self._orphans.append(abi.LaneRetire(req.lane_tag, publish_to_cache=True))
        if req in self.waiting:
            self.waiting.remove(req)
        req.lane_tag = None
        req.finish(FinishReason.ABORT, "handed over")  # releases its handles

    def flush_retires(self) -> None:
        """Run the pending retires now, in a tick of their own (nothing else moves)."""
        if self._orphans or any(r.retire_pending for r in self.running.values()):
            self._retire_now()

    def abort(self, req: Request) -> None:
        self.finish(req, FinishReason.ABORT)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._orphans)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ------------------------------------------------------------ one step
    def step(self, on_token: TokenCallback | None = None) -> list[RequestUpdate]:
        """Plan, run and apply one tick. With ``on_token`` the tick's tokens reach it as
        they are picked (partial emits, logprobs included); without, they come back in
        the returned updates. Either way a request finishes between ticks."""
        self.host.wait(idle=False)
        # Kept until a step returns: a tick that raises (a lost worker) must not lose them.
        self._carried += self._host_picks()
        if self.config.prefix_caching and self.waiting and any(r.retire_pending for r in self.running.values()):
            # Publish finished lanes before leasing, so a request that shares their
            # prefix (the next turn, a resent prompt) is leased from them.
            self._retire_now()
        leases = StepLeases(self.ex, self.config, self.desc.batch_invariant)
        try:
            updates = self._plan_and_run(Limits(), leases, on_token)
            carried, self._carried = self._carried, []
            return carried + updates
        finally:
            leases.release_unused(self.waiting)

    def _plan_and_run(self, limits: Limits, leases: StepLeases, on_token) -> list[RequestUpdate]:
        for _ in range(self.config.max_replans):
            self.rings.begin_prompts()
            tick = self.planner.build(self._view(), limits, leases, self.rings.write_prompt)
            if tick.preempt_for:
                # A waiting request of better priority than these lanes met a full batch or
                # pool: they give way (retired unpublished, replayed later to the same text).
                for victim in tick.preempt_for:
                    self._preempt(victim)
                continue
            if tick.empty and tick.waits_on_estimate and self._free_cells is not None:
                # Nothing runs, so no tick would ever refresh the estimate (from the last
                # tick's counters, taken before its retires gave cells back): without it,
                # the executor decides, and NeedsReplan sheds what does not fit.
                self._free_cells = None
                continue
            if tick.empty:
                self.host.wait(idle=True)  # only callbacks are running: let one answer
                return self._take_failed()
            live = [r for r in self.running.values() if not r.retire_pending]
            if tick.short_of_cells and len(live) > 1:
                # The last events say the running lanes will not all fit another round:
                # preempt now rather than let the runtime fault them mid-tick.
                self._preempt(self.policy.worst(live))
                limits.max_admits = 0  # not this tick: the preempted request would come right back
                continue
            self.rings.set_latency_wanted(tick.latency_sensitive)
            if self._protected_quota:
                tick.plan = msgspec.structs.replace(tick.plan, protected_quota_bytes=self._protected_quota)
            out, updates = self._run(tick, on_token)
            if out.status == abi.Status.OK:
                leases.used.update(a.lease.handle for a in tick.admissions if a.lease is not None)
                return self._take_failed() + updates
            self.stats.replans += 1
            if out.status == abi.Status.NEEDS_REPLAN:
                limits = self._relieve(tick, limits)
            elif out.status == abi.Status.REJECT_STALE_SEED:
                limits.use_leases = False
            else:
                raise SchedulerError(f"the executor rejected plan {tick.plan.plan_seq}: {abi.Status(out.status).name}")
        raise SchedulerError(f"no plan fit after {self.config.max_replans} re-plans")

    def _retire_now(self) -> None:
        for publish in (True, False):  # publishing needs cells the pool may not have: then without
            tick = self.planner.build(
                SchedulerView(running=list(self.running.values()), waiting=[], orphan_retires=self._orphans,
                              free_cells=None, draining=True),
                Limits(publish_retires=publish),
                lambda req: None,
                self.rings.write_prompt,
            )
            # Only the retires: running lanes make no progress in this tick.
            tick.plan = msgspec.structs.replace(tick.plan, prefills=[], decodes=[], admits=[], commits=[], flags=0,
                                                protected_quota_bytes=self._protected_quota)
            tick.prefills, tick.decodes = {}, {}
            out = self.ex.run_tick(tick.plan)
            if out.status == abi.Status.OK:
                self.update(tick, out.events)
                return
            if out.status != abi.Status.NEEDS_REPLAN:
                break
        raise SchedulerError(f"the executor rejected a retire-only plan: {abi.Status(out.status).name}")

    def _view(self) -> SchedulerView:
        waiting = self._admissible()
        return SchedulerView(
            running=list(self.running.values()),
            waiting=waiting,
            orphan_retires=self._orphans,
            free_cells=self._free_cells,
            orphan_cells=self._orphan_cells,
            draining=self.draining,
        )

    def _run(self, tick: ScheduledTick, on_token: TokenCallback | None) -> tuple[abi.TickOutcome, list[RequestUpdate]]:
        """Run the tick and apply its events. One path carries its tokens: the partial
        emits (streamed as they are picked) when the engine streams, else the events.
        Requests it ends finish after it, between ticks."""
        partial = self._streams_tokens(tick, on_token)
        callback = None
        if partial:
            tick.plan = msgspec.structs.replace(tick.plan, flags=tick.plan.flags | abi.TickFlag.PARTIAL_EMITS)
            callback = self._streamer(tick, on_token)
        self._ticking = True
        updates: dict[int, RequestUpdate] = {}
        applied = False
        try:
            out = self.ex.run_tick(tick.plan, on_partial_emit=callback)
            if out.status == abi.Status.OK:
                self.isolation.tested(a.request for a in tick.admissions)
                for a in tick.admissions:
                    a.request.handles.adopted_taken()
                self.update(tick, out.events, updates, tokens_streamed=partial)
            applied = True
        finally:
            self._ticking = False
            for req in self._end_requests():
                update_of(updates, req).finished = True
            if not applied:  # the tick raised (a lost worker): what it ended goes out with the next step
                self._carried += list(updates.values())
        return out, list(updates.values()) if out.status == abi.Status.OK else []

    def _streams_tokens(self, tick: ScheduledTick, on_token: TokenCallback | None) -> bool:
        """Whether this tick's tokens go out as partial emits: when the engine streams,
        unless a lane scores its prompt in it (prompt logprobs come in the events, and
        go out with the first token)."""
        if on_token is None or not self.config.partial_emits or not tick.decodes:
            return False
        scoring = [self.running[t] for t in tick.prefills if t in self.running] + [a.request for a in tick.admissions]
        return not any(r.params.prompt_logprobs is not None for r in scoring)

    def _end_requests(self) -> list[Request]:
        """Requests that ended while the tick ran finish now, between ticks."""
        ending, self._ending = self._ending, []
        for req in ending:
            reason, error = req.ending
            req.ending = None
            self.finish(req, reason, error)
        return ending

    def _streamer(self, tick: ScheduledTick, on_token: TokenCallback):
        by_tag = {a.lane_tag: a.request for a in tick.admissions}
        by_tag.update(self.running)
        admitted = {a.lane_tag: a for a in tick.admissions}

        def cb(emit: abi.PartialEmit) -> None:
            req = by_tag.get(emit.lane_tag)
            if emit.lane_tag in admitted:  # usage may go out with this very token
                self._count_admission(admitted[emit.lane_tag])
            if req is not None and self._arrive(req, emit.token):
                on_token(req, emit.token, emit.logprob)

        return cb

    def _arrive(self, req: Request, token: int) -> bool:
        """A generated token reaches its request, by whichever path its tick carries
        tokens. False: the request had already ended, and the token is dropped."""
        if req.done:
            return False
        req.replay_pending = False
        self._accept(req, token)
        return True


    def _host_picks(self) -> list[RequestUpdate]:
        """Accept the tokens host callbacks picked; a failed callback fails its request."""
        updates = []
        for req, tag, nonce, got in self.host.collect():
            u = RequestUpdate(req)
            updates.append(u)
            if isinstance(got, BaseException):
                message = str(got) if isinstance(got, HostPickError) else f"host sampling failed: {got!r}"
                self.finish(req, FinishReason.ERROR, message)
                u.finished = True
                continue
            u.new_token_ids.append(got.token)
            if got.logprob is not None:
                u.new_logprobs.append(msgspec.structs.replace(got.logprob, lane_tag=tag))
            self.stats.generation_tokens += 1
            if self._accept(req, got.token):
                if got.token in self.eos_ids and not req.params.ignore_eos:
                    self.finish(req, FinishReason.STOP)
                else:
                    req.host_commit = abi.HostCommit(tag, got.token, nonce)
            u.finished = req.is_finished
        return updates

    def _accept(self, req: Request, token: int) -> bool:
        """Append one generated token; False once the request is finished by it."""
        req.output_token_ids.append(token)
        if token in req.params.stop_token_ids:
            self.finish(req, FinishReason.STOP)
            return False
        if req.tokens_left <= 0:
            self.finish(req, FinishReason.LENGTH)
            return False
        return True

    # ------------------------------------------------------------ memory pressure
    def _relieve(self, tick: ScheduledTick, limits: Limits) -> Limits:
        """Tighten a plan the executor could not fit (pressure.py decides what goes)."""
        live = [r for r in self.running.values() if not r.retire_pending]
        relief = relieve(tick, limits, live, bool(self._orphans), self.policy.worst)
        if relief.preempt is not None:
            self._preempt(relief.preempt)
        if relief.fail is not None:
            self._fail(relief.fail, NO_FIT)
        return relief.limits

    def use_strategy(self, slot: int) -> None:
        """Admit lanes into the executor's speculative strategy at ``slot`` (0: none)."""
        self.planner.use_strategy(slot)

    def lanes_lost(self) -> list[Request]:
        """The executor is gone (its worker died) and a clean one took its place:
        every lane and handle is lost, no request is. Running requests go back to the
        queue to be re-admitted with their tokens replayed; returns every live
        request, whose handles the engine renews."""
        live = [r for r in self.running.values() if not r.is_finished]
        self.running.clear()
        self._orphans = []
        self._orphan_cells = 0
        self._free_cells = None
        for req in live:
            req.lane_tag = None
            self._requeue(req)
        return list(self.waiting)

    def _fail(self, req: Request, message: str) -> None:
        self.finish(req, FinishReason.ERROR, message)
        self._failed.append(req)

    def _take_failed(self) -> list[RequestUpdate]:
        failed, self._failed = self._failed, []
        return [RequestUpdate(r, finished=True) for r in failed]

    def _preempt(self, req: Request) -> None:
        self.running.pop(req.lane_tag, None)
        self._orphan_cells += cells_for(req.held_tokens(), self.desc.page)
        # Not published: the point is to give its cells back in this very plan.
        self._orphans.append(abi.LaneRetire(req.lane_tag, publish_to_cache=False))
        req.num_preemptions += 1
        self.stats.preemptions += 1
        req.lane_tag = None
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        self.host.forget(req)
        req.prefilled = 0
        req.replay_pending = False
        req.lane_finished = False
        req.retire_pending = False
        self.add(req)
