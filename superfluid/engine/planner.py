"""Decisions of one tick: which lanes retire, prefill, decode, and which requests
are admitted. Building a plan changes no request; ``Scheduler.update`` applies a
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
from .request import Request, Status, next_lane_tag

MAX_GRANT = 0xFFFF  # max_new_tokens is a u16 in the reference ABI


@dataclass
class Limits:
    """How a re-planned tick is tightened after NeedsReplan."""

    max_admits: int | None = None
    rounds: int | None = None
    prefill_budget: int | None = None
    use_seeds: bool = True


@dataclass(frozen=True)
class Seed:
    handle: int
    prefix_len: int


@dataclass
class Admission:
    request: Request
    lane_tag: int
    seed: Seed | None
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


class Planner:
    def __init__(self, config: SchedulerConfig, desc, max_running: int, policy: PriorityPolicy = PriorityPolicy()):
        self.config = config
        self.desc = desc
        self.max_running = max_running
        self.policy = policy
        self.strategy_slot = 0  # the loaded speculative strategy lanes opt into (0: none)
        self._plan_seq = 0

    def next_plan_seq(self) -> int:
        self._plan_seq += 1
        return self._plan_seq

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

    def build(
        self,
        view: SchedulerView,
        limits: Limits,
        lease: Callable[[Request], Seed | None],
        write_prompt: Callable[[list[int]], abi.RingRef],
    ) -> ScheduledTick:
        cfg = self.config
        tick = ScheduledTick(plan=abi.TickPlan(plan_seq=0))
        retires = list(view.orphan_retires)
        for req in view.running:
            if req.retire_pending:
                retires.append(abi.LaneRetire(req.lane_tag, publish_to_cache=cfg.prefix_caching))
                tick.retires.append(req.lane_tag)
        tick.retires += [r.lane_tag for r in view.orphan_retires]
        live = [r for r in view.running if not r.retire_pending]

        budget = cfg.prefill_token_budget if limits.prefill_budget is None else limits.prefill_budget
        page = self.desc.page

        def cost(held: int, add: int) -> int:
            return cells_added(held, add, page)

        # The free-cell estimate (None: the runtime does not count cells, NeedsReplan
        # decides). Running lanes come first: their chunks and one decode round each
        # are reserved before anything is admitted, so admissions never starve them.
        free = None if view.free_cells is None else view.free_cells + view.orphan_cells
        prefills: list[abi.PrefillChunk] = []
        # lanes fully prefilled after this tick: (request, lane tag, replay tokens to go, tokens held)
        ready: list[tuple[Request, int, int, int]] = []
        commits: list[abi.HostCommit] = []
        host_waiting = 0  # lanes whose rows are out with their callbacks
        for req in live:
            if req.lane_finished:
                continue  # waits for the engine to finish it; cannot decode again
            if req.host_commit is not None:
                commits.append(req.host_commit)
            elif req.host_row_out:
                host_waiting += 1
                continue  # its callbacks have not answered: no decode until they do
            take = min(req.prefill_end - req.prefilled, budget)
            if take > 0:
                prefills.append(abi.PrefillChunk(req.lane_tag, req.prefilled, take))
                tick.prefills[req.lane_tag] = take
                budget -= take
                if free is not None:
                    free -= cost(req.prefilled, take)
            if req.prefilled + take >= req.prefill_end:
                # A re-admitted lane replays its generated tokens before it samples; until
                # it emits, grant the whole replay again (a yield may have cut it short).
                replay_left = req.replay if req.replay_pending else 0
                held = req.held_tokens() + take
                ready.append((req, req.lane_tag, replay_left, held))
                if free is not None:
                    free -= cost(held, 1 + replay_left)
        tick.short_of_cells = free is not None and free < 0

        admits: list[abi.LaneAdmit] = []
        max_admits = len(view.waiting) if limits.max_admits is None else limits.max_admits
        n_lanes = len(live)
        blocked = False  # a waiting request could not be admitted (FCFS: none after it)
        # n > 1: the first choice's prompt is cached as soon as it is prefilled (on a
        # runtime whose copies share blocks; on a recurrent one as an exact checkpoint one
        # token short of its end), and its siblings wait for that, then fork from it
        # instead of each prefilling the prompt.
        forking = cfg.prefix_caching and limits.use_seeds and (self.desc.copy_shares_cells or self.desc.exact_only)
        leaders = {r.group_id: r for r in list(view.waiting) + live if r.index == 0 and r.group_id}
        siblings = {r.group_id for r in view.waiting if r.index > 0}
        if not view.draining and not tick.short_of_cells:
            for req in view.waiting:
                lead = leaders.get(req.group_id) if forking and req.index > 0 and not req.output_token_ids else None
                if lead is not None and not lead.is_finished and (lead.status is Status.WAITING or not lead.prefill_done):
                    continue  # forks once the first choice's prompt is cached
                if len(admits) >= max_admits:
                    blocked = True
                    break
                if n_lanes >= self.max_running:
                    victims = self.policy.victims(live, req)
                    if victims:
                        tick.preempt_for = victims[:1]
                        return tick
                    blocked = True
                    break
                history = req.history
                seed = lease(req) if (cfg.prefix_caching and limits.use_seeds) else None
                prefix = seed.prefix_len if seed else 0
                replay = len(req.output_token_ids)
                prefill_end = max(len(history) - replay, prefix)
                need = prefill_end - prefix
                if need > 0 and budget <= 0:
                    blocked = True
                    break
                take = min(need, budget)
                # a seed's copy, the chunk, the replay and a first token
                copied = 0 if self.desc.copy_shares_cells else prefix
                cells = cost(0, copied) + cost(prefix, take + (len(history) - prefill_end) + 1)
                if free is not None and cells > free:
                    tick.preempt_for = self._give_way(live, req, cells - free)
                    if tick.preempt_for:
                        return tick
                    blocked = True
                    break
                tag = next_lane_tag()
                p = req.params
                admits.append(
                    abi.LaneAdmit(
                        lane_tag=tag,
                        prompt=write_prompt(history),
                        sampling=p.abi_sampling(),
                        params=p.abi_params(),
                        # The same base: the executor starts a lane's draw counter at its
                        # decode_replay, so a re-admitted lane draws where it left off.
                        rng_counter_base=req.rng_base,
                        decode_replay=replay,
                        strategy_slot=self.strategy_slot,
                        grammar_handle=req.grammar_handle,
                        grammar_replay=replay if req.grammar_handle else 0,
                        logit_bias_handle=req.logit_bias_handle,
                        seed_handle=seed.handle if seed else 0,
                        determinism_class=cfg.determinism_class,
                        want_logprobs=p.want_logprobs(),
                        want_prompt_logprobs=p.want_prompt_logprobs(),
                        cache_key=req.cache_key,
                        cache_retention=req.cache_retention,
                        publish_prompt=forking and req.index == 0 and req.group_id in siblings,
                    )
                )
                tick.admissions.append(Admission(req, tag, seed, prefill_end, len(history) - prefill_end))
                if take > 0:
                    prefills.append(abi.PrefillChunk(tag, prefix, take))
                    tick.prefills[tag] = take
                    budget -= take
                if free is not None:
                    free -= cells
                n_lanes += 1
                if take == need:
                    ready.append((req, tag, len(history) - prefill_end, len(history)))

        # Several rounds per tick amortize the tick's overhead, but only while nobody
        # waits for a first token (a waiting request, a lane still prefilling) and the
        # pool has room for them; one round's cells were reserved above.
        still_prefilling = n_lanes - host_waiting > len(ready)
        waiting_left = len(view.waiting) > len(admits)
        tick.latency_sensitive = bool(waiting_left and not view.draining) or still_prefilling or blocked
        rounds = 1 if tick.latency_sensitive else cfg.max_rounds
        if limits.rounds is not None:
            rounds = min(rounds, limits.rounds)
        if any(r.params.host_sampled for r in live):
            rounds = 1  # a host lane takes a token a tick: longer ticks would hold it back
        if rounds > 1 and free is not None:
            extra = sum(cost(held, r + min(rounds, req.tokens_left)) - cost(held, r + 1) for req, _, r, held in ready)
            if extra > free:
                rounds = 1
        decodes: list[abi.LaneDecode] = []
        for req, tag, replay_left, _ in ready:
            k = min(min(rounds, req.tokens_left) + replay_left, MAX_GRANT)
            if req.params.host_sampled:
                k = min(1 + replay_left, MAX_GRANT)  # one row, after the replay
            if k <= 0:
                continue
            decodes.append(abi.LaneDecode(tag, k))
            tick.decodes[tag] = k

        tick.plan = abi.TickPlan(
            plan_seq=self.next_plan_seq(),
            commits=commits,
            flags=abi.TickFlag.DRAIN if view.draining else 0,
            admits=admits,
            prefills=prefills,
            decodes=decodes,
            retires=retires,
            prefill_token_budget=cfg.prefill_token_budget if limits.prefill_budget is None else limits.prefill_budget,
            # Prefix-cache entries give way to live work whenever the pool is short.
            evictable_cache_classes=abi.CacheClass.RESIDENT_PREFIX,
            max_evict_bytes=1 << 62,
        )
        return tick
