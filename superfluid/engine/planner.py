"""Decisions of one tick: which lanes retire, prefill, decode, and which requests
are admitted. Building a plan changes no request; the ``RequestTable`` applies a
``ScheduledTick`` once the executor accepted it, so a plan answered with
``NeedsReplan`` is simply rebuilt under tighter ``Limits``.

"There is no prefill phase, only tokens to catch up": a lane's history is
prefilled in chunks under the tick's token budget, and the tick that completes
it may decode too (its first token comes from the prefill's last row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .. import abi
from ..pages import cells_added, cells_for
from .config import SchedulerConfig
from .priority import PriorityPolicy
from .lifecycle import LIVE, QUEUED, RETIRES
from .request import Request, next_lane_tag

MAX_GRANT = 0xFFFF  # max_new_tokens is a u16 in the reference ABI


@dataclass
class Limits:
    """How a re-planned tick is tightened after NeedsReplan."""

    max_admits: int | None = None
    rounds: int | None = None
    prefill_budget: int | None = None
    use_leases: bool = True
    # False: finished lanes retire without publishing to the cache. A publishing retire
    # needs a cell for its pending token; on a pool full of live lanes and pinned entries
    # that cell may not exist, and giving up the publication is the last thing to give up.
    publish_retires: bool = True


@dataclass
class Admission:
    request: Request
    lane_tag: int
    lease: abi.Lease | None
    prefill_end: int
    replay: int


@dataclass
class ScheduledTick:
    plan: abi.TickPlan
    admissions: list[Admission] = field(default_factory=list)
    prefills: dict[int, int] = field(default_factory=dict)  # lane tag -> tokens planned
    decodes: dict[int, int] = field(default_factory=dict)  # lane tag -> rounds granted
    retires: list[int] = field(default_factory=list)
    latency_sensitive: bool = False
    short_of_cells: bool = False  # the estimate says running lanes alone do not fit
    waits_on_estimate: bool = False  # an admission waits because the free-cell estimate says it does not fit
    # Running requests that must give way to a better-priority waiting one (the plan is
    # not run: the scheduler preempts them and plans again).
    preempt_for: list[Request] | None = None

    @property
    def empty(self) -> bool:
        p = self.plan
        return not (p.admits or p.prefills or p.decodes or p.retires)


@dataclass
class SchedulerView:
    """What the planner reads of the scheduler."""

    running: list[Request]  # admission order
    waiting: list[Request]  # priority order (FCFS among equals)
    orphan_retires: list[abi.LaneRetire]  # lanes of preempted requests
    free_cells: int | None  # estimate from the last events; None: unknown
    orphan_cells: int = 0  # cells the orphan retires give back
    draining: bool = False


@dataclass
class _Draft:
    """A plan being built: what it holds so far and what is left of the tick's means."""

    budget: int  # prefill tokens left
    free: int | None  # cells left, by the estimate (None: not counted; NeedsReplan decides)
    n_lanes: int  # lanes after this tick: the live ones, then each admission
    prefills: list[abi.PrefillChunk] = field(default_factory=list)
    commits: list[abi.HostCommit] = field(default_factory=list)
    admits: list[abi.LaneAdmit] = field(default_factory=list)
    # lanes fully prefilled after this tick: (request, lane tag, replay tokens to go, tokens held)
    ready: list[tuple[Request, int, int, int]] = field(default_factory=list)
    host_waiting: int = 0  # lanes whose rows are out with their callbacks
    blocked: bool = False  # a waiting request could not be admitted (FCFS: none after it)

    def reserve(self, cells: int) -> None:
        if self.free is not None:
            self.free -= cells

    def prefill(self, tick: ScheduledTick, lane_tag: int, offset: int, take: int) -> None:
        self.prefills.append(abi.PrefillChunk(lane_tag, offset, take))
        tick.prefills[lane_tag] = take
        self.budget -= take


class Planner:
    def __init__(self, config: SchedulerConfig, desc, max_running: int, policy: PriorityPolicy = PriorityPolicy()):
        self.config = config
        self.desc = desc
        self.max_running = max_running
        self.policy = policy
        self._strategy_slot = 0  # the loaded speculative strategy lanes opt into (0: none)
        self._plan_seq = 0

    def use_strategy(self, slot: int) -> None:
        """Admit lanes into the speculative strategy loaded at ``slot`` (0: none). A
        restarted executor loads it anew, under a slot of its own."""
        self._strategy_slot = slot

    def next_plan_seq(self) -> int:
        self._plan_seq += 1
        return self._plan_seq

    def build(
        self,
        view: SchedulerView,
        limits: Limits,
        lease: Callable[[Request], abi.Lease | None],
        write_prompt: Callable[[list[int]], abi.RingRef],
    ) -> ScheduledTick:
        """Retires, then the running lanes' chunks and one decode round each (reserved
        before anything is admitted, so admissions never starve them), then admissions,
        then the rounds every ready lane is granted."""
        cfg = self.config
        tick = ScheduledTick(plan=abi.TickPlan(plan_seq=0))
        retires, live = self._retires(view, tick, limits.publish_retires)
        budget = cfg.prefill_token_budget if limits.prefill_budget is None else limits.prefill_budget
        free = None if view.free_cells is None else view.free_cells + view.orphan_cells
        draft = _Draft(budget=budget, free=free, n_lanes=len(live))
        self._continue_running(live, draft, tick)
        tick.short_of_cells = draft.free is not None and draft.free < 0
        if not view.draining and not tick.short_of_cells:
            tick.preempt_for = self._admit_waiting(view, limits, lease, write_prompt, live, draft, tick)
            if tick.preempt_for:
                return tick
        decodes = self._grant_decodes(draft, self._rounds(view, limits, live, draft, tick), tick)
        tick.plan = abi.TickPlan(
            plan_seq=self.next_plan_seq(),
            commits=draft.commits,
            flags=abi.TickFlag.DRAIN if view.draining else 0,
            admits=draft.admits,
            prefills=draft.prefills,
            decodes=decodes,
            retires=retires,
            prefill_token_budget=budget,
            # Prefix-cache entries give way to live work whenever the pool is short.
            evictable_cache_classes=abi.CacheClass.RESIDENT_PREFIX,
            max_evict_bytes=1 << 62,
        )
        return tick

    def _retires(self, view: SchedulerView, tick: ScheduledTick, publish: bool
                 ) -> tuple[list[abi.LaneRetire], list[Request]]:
        """The lanes that end this tick (those of ended requests publish their state to
        the cache unless ``publish`` is off; preempted ones do not), and the live rest."""
        retires = list(view.orphan_retires)
        for req in view.running:
            if req.phase in RETIRES:
                retires.append(abi.LaneRetire(req.lane_tag, publish_to_cache=self.config.prefix_caching and publish))
                tick.retires.append(req.lane_tag)
        tick.retires += [r.lane_tag for r in view.orphan_retires]
        return retires, [r for r in view.running if r.phase in LIVE]

    def _continue_running(self, live: list[Request], draft: _Draft, tick: ScheduledTick) -> None:
        """Each running lane's next prefill chunk (or host commit), and one decode round
        for each that is fully prefilled after it."""
        page = self.desc.page
        for req in live:
            if req.host_commit is not None:
                draft.commits.append(req.host_commit)
            elif req.host_row_out:
                draft.host_waiting += 1
                continue  # its callbacks have not answered: no decode until they do
            take = min(req.prefill_end - req.prefilled, draft.budget)
            if take > 0:
                draft.prefill(tick, req.lane_tag, req.prefilled, take)
                draft.reserve(cells_added(req.prefilled, take, page))
            if req.prefilled + take >= req.prefill_end:
                # A re-admitted lane replays its generated tokens before it samples; until
                # it emits, grant the whole replay again (a yield may have cut it short).
                replay_left = req.replay if req.replay_pending else 0
                held = req.held_tokens() + take
                draft.ready.append((req, req.lane_tag, replay_left, held))
                draft.reserve(cells_added(held, 1 + replay_left, page))

    def _admit_waiting(
        self, view: SchedulerView, limits: Limits, lease, write_prompt, live: list[Request], draft: _Draft,
        tick: ScheduledTick,
    ) -> list[Request] | None:
        """Admit waiting requests in priority order while the batch, the prefill budget
        and the pool allow; the first that cannot go blocks those after it (FCFS).
        Returns the running requests that must give way to a better-priority one
        instead (then the plan is not run)."""
        cfg = self.config
        max_admits = len(view.waiting) if limits.max_admits is None else limits.max_admits
        # n > 1: the first choice's prompt is cached as soon as it is prefilled (on a
        # runtime whose copies share blocks; on a recurrent one as an exact checkpoint one
        # token short of its end), and its siblings wait for that, then fork from it
        # instead of each prefilling the prompt.
        forking = cfg.prefix_caching and limits.use_leases and (self.desc.copy_shares_cells or self.desc.exact_only)
        leaders = {r.group_id: r for r in list(view.waiting) + live if r.index == 0 and r.group_id}
        siblings = {r.group_id for r in view.waiting if r.index > 0}
        for req in view.waiting:
            lead = leaders.get(req.group_id) if forking and req.index > 0 and not req.output_token_ids else None
            if lead is not None and lead.takes_tokens and (lead.phase in QUEUED or not lead.prefill_done):
                continue  # forks once the first choice's prompt is cached
            if len(draft.admits) >= max_admits:
                break
            if draft.n_lanes >= self.max_running:
                victims = self.policy.victims(live, req)
                if victims:
                    return victims[:1]
                break
            leased = lease(req) if (cfg.prefix_caching and limits.use_leases) else None
            prefix = leased.prefix_len if leased else 0
            replay = len(req.output_token_ids)
            prefill_end = max(len(req.history) - replay, prefix)
            need = prefill_end - prefix
            if need > 0 and draft.budget <= 0:
                break
            take = min(need, draft.budget)
            cells = self._admit_cells(prefix, take + (len(req.history) - prefill_end) + 1)
            if draft.free is not None and cells > draft.free:
                victims = self._give_way(live, req, cells - draft.free)
                if victims:
                    return victims
                tick.waits_on_estimate = True
                break
            publish = forking and req.index == 0 and req.group_id in siblings
            self._admit(req, leased, prefill_end, take, publish, write_prompt, draft, tick)
            draft.reserve(cells)
        else:
            return None
        draft.blocked = True  # every break above: this request cannot go now, nor those after it
        return None

    def _admit_cells(self, prefix: int, add: int) -> int:
        """Cells a new lane takes: a lease's copy, then ``add`` tokens past the prefix (the
        chunk, the replay and a first token)."""
        copied = 0 if self.desc.copy_shares_cells else prefix
        return cells_for(copied, self.desc.page) + cells_added(prefix, add, self.desc.page)

    def _admit(
        self, req: Request, leased: abi.Lease | None, prefill_end: int, take: int, publish: bool, write_prompt,
        draft: _Draft, tick: ScheduledTick,
    ) -> None:
        """A new lane for ``req``: its admit, its first prefill chunk, a place among the
        ready lanes once the chunk completes its prefill."""
        history = req.history
        prefix = leased.prefix_len if leased else 0
        replay = len(req.output_token_ids)
        tag = next_lane_tag()
        p = req.params
        draft.admits.append(
            abi.LaneAdmit(
                lane_tag=tag,
                prompt=write_prompt(history),
                sampling=p.abi_sampling(),
                params=p.abi_params(),
                # The same base: the executor starts a lane's draw counter at its
                # decode_replay, so a re-admitted lane draws where it left off.
                rng_counter_base=req.rng_base,
                decode_replay=replay,
                strategy_slot=self._strategy_slot,
                grammar_handle=req.handles.grammar,
                grammar_replay=replay if req.handles.grammar else 0,
                logit_bias_handle=req.handles.logit_bias,
                token_rules_handle=req.handles.token_rules,
                lease_handle=leased.handle if leased else 0,
                determinism_class=self.config.determinism_class,
                want_logprobs=p.want_logprobs(),
                want_prompt_logprobs=p.want_prompt_logprobs(),
                cache_key=req.cache_key,
                cache_retention=req.cache_retention,
                publish_prompt=publish,
            )
        )
        tick.admissions.append(Admission(req, tag, leased, prefill_end, len(history) - prefill_end))
        if take > 0:
            draft.prefill(tick, tag, prefix, take)
        draft.n_lanes += 1
        if take == prefill_end - prefix:
            draft.ready.append((req, tag, len(history) - prefill_end, len(history)))

    def _give_way(self, live: list[Request], req: Request, short: int) -> list[Request] | None:
        """The fewest worse-priority running requests whose cells cover ``short``; None
        when even all of them would not (then nobody is preempted for nothing)."""
        chosen, freed = [], 0
        for victim in self.policy.victims(live, req):
            chosen.append(victim)
            freed += cells_for(victim.held_tokens(), self.desc.page)
            if freed >= short:
                return chosen
        return None

    def _rounds(self, view: SchedulerView, limits: Limits, live: list[Request], draft: _Draft, tick: ScheduledTick) -> int:
        """Several rounds per tick amortize the tick's overhead, but only while nobody
        waits for a first token (a waiting request, a lane still prefilling) and the
        pool has room for them; one round's cells were reserved already."""
        still_prefilling = draft.n_lanes - draft.host_waiting > len(draft.ready)
        waiting_left = len(view.waiting) > len(draft.admits)
        tick.latency_sensitive = bool(waiting_left and not view.draining) or still_prefilling or draft.blocked
        rounds = 1 if tick.latency_sensitive else self.config.max_rounds
        if limits.rounds is not None:
            rounds = min(rounds, limits.rounds)
        if any(r.params.host_sampled for r in live):
            rounds = 1  # a host lane takes a token a tick: longer ticks would hold it back
        if rounds > 1 and draft.free is not None:
            page = self.desc.page
            extra = sum(
                cells_added(held, r + min(rounds, req.tokens_left), page) - cells_added(held, r + 1, page)
                for req, _, r, held in draft.ready
            )
            if extra > draft.free:
                rounds = 1
        return rounds

    def _grant_decodes(self, draft: _Draft, rounds: int, tick: ScheduledTick) -> list[abi.LaneDecode]:
        """Each ready lane's grant: its rounds (as many tokens as it has left) after
        whatever replay it has to go, capped at the ABI's u16."""
        decodes: list[abi.LaneDecode] = []
        for req, tag, replay_left, _ in draft.ready:
            k = min(min(rounds, req.tokens_left) + replay_left, MAX_GRANT)
            if req.params.host_sampled:
                k = min(1 + replay_left, MAX_GRANT)  # one row, after the replay
            if k <= 0:
                continue
            decodes.append(abi.LaneDecode(tag, k))
            tick.decodes[tag] = k
        return decodes
