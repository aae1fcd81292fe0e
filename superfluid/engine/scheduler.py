"""Continuous batching over the tick contract.

The Scheduler composes the pieces, each the owner of one thing: the ``RequestTable``
(request_table.py) owns the requests and their lifecycle; the ``Planner`` builds a
plan from them; ``StepLeases`` (leasing.py) the step's prefix leases; the ``Finisher``
(finisher.py) takes every token and decides where requests end; ``PoolEstimate`` what
the pool has left; ``FaultIsolation`` whom a failed step is blamed on; the
``HostSampler`` the rows out with host callbacks.

A plan the executor answers with ``NeedsReplan`` changed nothing, so the step rebuilds
it tighter: fewer admissions, then one decode round, then a preempted lane (retired
without publishing, re-admitted later with ``decode_replay``), and only when a single
request cannot fit alone does that request fail (pressure.py decides which).

Tokens reach the Finisher by one door, as ``TokenEvent``s in the order they happened:
host picks first, then a tick's tokens (as partial emits while it runs when the engine
streams, else from its events), each followed by the finish its lane reported. Ends
are verdicts while the step runs and settle when the engine calls ``settle`` between
steps.

Threading: every method runs on the engine's loop thread, except that another
thread may raise the rings' yield flag (``rings.request_yield``) to cut a running
tick short when a request arrives.
"""

from __future__ import annotations

import msgspec

from .. import abi
from .config import SchedulerConfig
from .finisher import Finisher
from .host_pick import HostPickError
from .host_sampling import HostSampler
from .isolation import FaultIsolation
from .leasing import StepLeases
from .planner import Limits, Planner, ScheduledTick, SchedulerView
from .pool_estimate import PoolEstimate
from .pressure import NO_FIT, relieve
from .outputs import ErrorCode
from .priority import PriorityPolicy
from .request import FinishReason, Request
from .request_table import Detached, Ended, LanesLost, Preempted, Queued, RequestTable, Settled, TickApplied, Withdrawn
from .token_events import Source, TokenEvent
from .updates import SchedulerError, SchedulerStats

_FINISH = {abi.Finish.EOS: FinishReason.STOP, abi.Finish.LENGTH: FinishReason.LENGTH, abi.Finish.GRAMMAR: FinishReason.STOP}


class Scheduler:
    def __init__(self, executor, rings, config: SchedulerConfig = SchedulerConfig(), eos_ids: frozenset[int] = frozenset()):
        self.ex = executor
        self.rings = rings
        self.config = config
        self.desc = executor.desc
        self.max_running = config.max_running or self.desc.max_batch
        self.policy = PriorityPolicy(config.scheduling_policy, config.priority_aging_s)
        self.planner = Planner(config, self.desc, self.max_running, self.policy)
        self.host = HostSampler(config.host_threads, config.host_grace_s)
        self.stats = SchedulerStats()
        self.table = RequestTable(config, self.desc, self.policy, self.stats)
        self.finisher = Finisher(self.table, eos_ids)  # a host-picked EOS ends its request there
        self.pool = PoolEstimate(config, self.desc, self.stats)
        self.isolation = FaultIsolation()
        self.draining = False
        self.streams = False  # a tick's tokens go out while it runs (partial emits)

    # ------------------------------------------------------------ requests
    def add(self, req: Request, fresh: bool = False) -> None:
        """Queue a request; ``fresh``: newly submitted (it has never been in a tick)."""
        self.policy.key(req)  # a request whose place cannot be computed is refused before it queues
        if fresh:
            self.isolation.submitted(req)
        self.table.apply(Queued(req))

    def forget(self, req: Request) -> None:
        """Take a request that never ran out of the queue (a submission that failed
        part-way is undone whole)."""
        self.table.apply(Withdrawn(req))
        self.isolation.forget(req)

    def end(self, req: Request, reason: FinishReason, error: str | None = None, code: ErrorCode | None = None) -> None:
        """A verdict from outside the token stream (an abort, a failure): the request
        takes no more tokens; its end settles with the next ``settle``."""
        self.table.apply(Ended(req, reason, error, code))

    def settle(self) -> list[Request]:
        """Between steps: the requests that ended finish (handles released, a live lane
        retires at the next tick); returns them, in the order they ended."""
        return self.table.apply(Settled())

    def isolate(self, error: BaseException) -> list[Request] | None:
        """A step raised ``error``: the new request it is blamed on ends with the error
        (returned); [] when several suspects went on probation; None when no new request
        can be blamed (isolation.py)."""
        blamed = self.isolation.blame()
        for req in blamed or ():
            self.end(req, FinishReason.ERROR, f"the request could not be run: {error!r}", ErrorCode.BLAMED)
        return blamed

    def detach(self, req: Request) -> None:
        """The request leaves this engine unfinished (handed over): its lane, if any,
        retires at the next tick *publishing* its state to the cache."""
        self.table.apply(Detached(req))

    def flush_retires(self) -> None:
        """Run the pending retires now, in a tick of their own (nothing else moves)."""
        if self.table.orphans or self.table.retiring():
            self._retire_now()

    def has_work(self) -> bool:
        return self.table.has_work()

    @property
    def num_waiting(self) -> int:
        return len(self.table.waiting)

    @property
    def num_running(self) -> int:
        return len(self.table.running)

    def use_strategy(self, slot: int) -> None:
        """Admit lanes into the executor's speculative strategy at ``slot`` (0: none)."""
        self.planner.use_strategy(slot)

    def lanes_lost(self) -> list[Request]:
        """The executor is gone (its worker died) and a clean one took its place:
        every lane and handle is lost, no request is. Running requests go back to the
        queue to be re-admitted with their tokens replayed; returns every queued
        request, whose handles the engine renews."""
        self.table.apply(LanesLost())
        self.pool.forget()
        return list(self.table.waiting)

    # ------------------------------------------------------------ one step
    def step(self) -> None:
        """Take the host picks, then plan, run and absorb one tick; every token goes to
        the Finisher as it arrives."""
        self.host.wait(idle=False)
        self._take_host_picks()
        if self.config.prefix_caching and self.table.waiting and self.table.retiring():
            # Publish finished lanes before leasing, so a request that shares their
            # prefix (the next turn, a resent prompt) is leased from them.
            self._retire_now()
        with StepLeases(self.ex, self.config, self.desc.batch_invariant, self.table.waiting) as leases:
            ran = self._plan_and_run(Limits(), leases)
        if ran is not None:
            self._absorb(*ran)

    def _plan_and_run(self, limits: Limits, leases: StepLeases
                      ) -> tuple[ScheduledTick, abi.TickEvents, bool] | None:
        """The accepted tick, its events and whether its tokens were streamed; None when
        there was nothing to run."""
        for _ in range(self.config.max_replans):
            self.rings.begin_prompts()
            tick = self.planner.build(self._view(), limits, leases, self.rings.write_prompt)
            if tick.preempt_for:
                # A waiting request of better priority than these lanes met a full batch or
                # pool: they give way (retired unpublished, replayed later to the same text).
                for victim in tick.preempt_for:
                    self.table.apply(Preempted(victim))
                continue
            if tick.empty and tick.waits_on_estimate and self.pool.free_cells is not None:
                # Nothing runs, so no tick would ever refresh the estimate (from the last
                # tick's counters, taken before its retires gave cells back): without it,
                # the executor decides, and NeedsReplan sheds what does not fit.
                self.pool.forget()
                continue
            if tick.empty:
                self.host.wait(idle=True)  # only callbacks are running: let one answer
                return None
            live = self.table.live()
            if tick.short_of_cells and len(live) > 1:
                # The last events say the running lanes will not all fit another round:
                # preempt now rather than let the runtime fault them mid-tick.
                self.table.apply(Preempted(self.policy.worst(live)))
                limits.max_admits = 0  # not this tick: the preempted request would come right back
                continue
            out, streamed = self._run(tick)
            if out.status == abi.Status.OK:
                leases.consumed(tick.admissions)
                return tick, out.events, streamed
            self.stats.replans += 1
            if out.status == abi.Status.NEEDS_REPLAN:
                limits = self._relieve(tick, limits)
            elif out.status == abi.Status.REJECT_STALE_LEASE:
                limits.use_leases = False
            else:
                raise SchedulerError(f"the executor rejected plan {tick.plan.plan_seq}: {abi.Status(out.status).name}")
        raise SchedulerError(f"no plan fit after {self.config.max_replans} re-plans")

    def _run(self, tick: ScheduledTick) -> tuple[abi.TickOutcome, bool]:
        """Run the tick; when the engine streams, its tokens reach the Finisher as partial
        emits while it runs (unless a lane scores its prompt in it: prompt logprobs come
        in the events, and go out with the first token)."""
        self.rings.set_latency_wanted(tick.latency_sensitive)
        plan = tick.plan
        if self.pool.protected_quota:
            plan = msgspec.structs.replace(plan, protected_quota_bytes=self.pool.protected_quota)
        streamed = self._streams_tokens(tick)
        callback = None
        if streamed:
            plan = msgspec.structs.replace(plan, flags=plan.flags | abi.TickFlag.PARTIAL_EMITS)
            by_tag = {a.lane_tag: a.request for a in tick.admissions}
            by_tag.update(self.table.running)

            def callback(emit: abi.PartialEmit) -> None:
                req = by_tag.get(emit.lane_tag)
                if req is not None:
                    self.finisher.take(TokenEvent(req, emit.token, emit.logprob))

        tick.plan = plan
        return self.ex.run_tick(plan, on_partial_emit=callback), streamed

    def _streams_tokens(self, tick: ScheduledTick) -> bool:
        if not self.streams or not self.config.partial_emits or not tick.decodes:
            return False
        running = self.table.running
        scoring = [running[t] for t in tick.prefills if t in running] + [a.request for a in tick.admissions]
        return not any(r.params.prompt_logprobs is not None for r in scoring)

    def _absorb(self, tick: ScheduledTick, events: abi.TickEvents, streamed: bool) -> None:
        """An accepted tick: the table applies it; its tokens (unless they were streamed)
        and its lanes' finishes go to the Finisher; host lanes' rows to their callbacks."""
        self.isolation.tested(a.request for a in tick.admissions)
        for a in tick.admissions:
            a.request.handles.adopted_taken()
        self.table.apply(TickApplied(tick, events))
        logprobs: dict[int, list[abi.LaneLogprob]] = {}
        for lp in events.logprobs:
            logprobs.setdefault(lp.lane_tag, []).append(lp)
        for emit in events.emits:
            req = self.table.running.get(emit.lane_tag)
            if req is None:
                continue
            if emit.logits_row.length and req.takes_tokens:
                # A host lane's row: copied now, before the next tick rewrites the ring.
                self.host.submit(req, emit.lane_tag, emit.logits_row.generation, self.rings.read_logits_row(emit.logits_row))
            tokens = [] if streamed or not emit.n_tokens else self.rings.read_emits(emit.token_ref)
            lps = logprobs.get(emit.lane_tag, [])
            for i, token in enumerate(tokens):
                self.finisher.take(TokenEvent(req, token, lps[i] if i < len(lps) else None))
            if emit.finish != abi.Finish.NONE:
                self.finisher.take(TokenEvent(req, finish=_FINISH.get(abi.Finish(emit.finish), FinishReason.STOP)))
        self.pool.note(events.mem)

    def _take_host_picks(self) -> None:
        """The tokens host callbacks picked go to the Finisher; one that goes on is
        committed with its row's nonce in the next plan. A failed callback ends its
        request."""
        for req, tag, nonce, got in self.host.collect():
            if isinstance(got, BaseException):
                message = str(got) if isinstance(got, HostPickError) else f"host sampling failed: {got!r}"
                self.end(req, FinishReason.ERROR, message, ErrorCode.CALLBACK_FAILED)
                continue
            lp = msgspec.structs.replace(got.logprob, lane_tag=tag) if got.logprob is not None else None
            self.stats.generation_tokens += 1
            self.finisher.take(TokenEvent(req, got.token, lp, Source.HOST))
            if req.takes_tokens:
                req.host_commit = abi.HostCommit(tag, got.token, nonce)

    def _retire_now(self) -> None:
        for publish in (True, False):  # publishing needs cells the pool may not have: then without
            tick = self.planner.build(
                SchedulerView(running=list(self.table.running.values()), waiting=[],
                              orphan_retires=self.table.orphans, free_cells=None, draining=True),
                Limits(publish_retires=publish),
                lambda req: None,
                self.rings.write_prompt,
            )
            # Only the retires: running lanes make no progress in this tick.
            tick.plan = msgspec.structs.replace(tick.plan, prefills=[], decodes=[], admits=[], commits=[], flags=0,
                                                protected_quota_bytes=self.pool.protected_quota)
            tick.prefills, tick.decodes = {}, {}
            out = self.ex.run_tick(tick.plan)
            if out.status == abi.Status.OK:
                self.table.apply(TickApplied(tick, out.events))
                self.pool.note(out.events.mem)
                return
            if out.status != abi.Status.NEEDS_REPLAN:
                break
        raise SchedulerError(f"the executor rejected a retire-only plan: {abi.Status(out.status).name}")

    def _view(self) -> SchedulerView:
        t = self.table
        waiting = t.waiting
        if any(r.handles.grammar_pending for r in waiting):  # still compiling: not yet
            waiting = [r for r in waiting if not r.handles.grammar_pending]
        return SchedulerView(
            running=list(t.running.values()),
            waiting=self.isolation.admissible(waiting, t.waiting),
            orphan_retires=t.orphans,
            free_cells=self.pool.free_cells,
            orphan_cells=t.orphan_cells,
            draining=self.draining,
        )

    def _relieve(self, tick: ScheduledTick, limits: Limits) -> Limits:
        """Tighten a plan the executor could not fit (pressure.py decides what goes)."""
        relief = relieve(tick, limits, self.table.live(), bool(self.table.orphans), self.policy.worst)
        if relief.preempt is not None:
            self.table.apply(Preempted(relief.preempt))
        if relief.fail is not None:
            self.end(relief.fail, FinishReason.ERROR, NO_FIT, ErrorCode.NO_FIT)
        return relief.limits
