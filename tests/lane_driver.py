"""A minimal scheduler for executor tests: drives lanes tick by tick the way the
engine does, reading progress only from events (shed chunks, emits, finishes)."""

from __future__ import annotations

from dataclasses import dataclass, field

from superfluid.abi import (
    HostCommit,
    LaneAdmit,
    LaneDecode,
    LaneRetire,
    PrefillChunk,
    Sampling,
    LaneParams,
    ShedKind,
    Status,
    TickPlan,
)
from superfluid.executor import Executor
from superfluid import sampling as hs


@dataclass
class LaneRun:
    tag: int
    prompt: list[int]
    max_tokens: int
    sampling: int = Sampling.GREEDY
    params: LaneParams = LaneParams()
    chunk: int = 1 << 30
    rounds: int = 4
    lease_handle: int = 0
    prefilled: int = 0
    prefill_end: int = 0
    decode_replay: int = 0
    strategy_slot: int = 0
    grammar_handle: int = 0
    grammar_replay: int = 0
    logit_bias_handle: int = 0
    want_logprobs: int = 0
    rng_base: int = 0
    admitted: bool = False
    out: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish: int = 0
    fault: int = 0
    row: object = None  # host lanes: (nonce, row) waiting to be committed
    replayed: int = 0  # decode-replay tokens the executor fed (they use decode rounds)

    @property
    def done(self) -> bool:
        return bool(self.finish or self.fault or len(self.out) >= self.max_tokens)


class Driver:
    def __init__(self, ex: Executor):
        self.ex = ex
        self.seq = 0
        self.lanes: dict[int, LaneRun] = {}
        self.events = []
        self.lease_lens: dict[int, int] = {}  # lease handle -> prefix length

    def lease(self, prompt: list[int]):
        lease = self.ex.lease_prefix(prompt)
        if lease is not None:
            self.lease_lens[lease.handle] = lease.prefix_len
        return lease

    def add(self, run: LaneRun) -> LaneRun:
        if run.lease_handle:
            h = run.lease_handle
            run.prefilled = self.lease_lens[h] if h in self.lease_lens else self.ex.leases[h].prefix_len
        run.prefill_end = max(len(run.prompt) - run.decode_replay, run.prefilled)
        self.lanes[run.tag] = run
        return run

    def plan(self, yield_now: bool = False, **extra) -> TickPlan:
        self.seq += 1
        r = self.ex.rings
        r.begin_prompts()
        admits, prefills, decodes, commits, retires = [], [], [], [], []
        for run in self.lanes.values():
            if run.done:
                continue
            if not run.admitted:
                admits.append(
                    LaneAdmit(
                        run.tag, r.write_prompt(run.prompt), run.sampling, run.params, run.rng_base,
                        run.decode_replay, run.strategy_slot, run.grammar_handle, run.grammar_replay,
                        run.logit_bias_handle, run.lease_handle, 0, run.want_logprobs,
                    )
                )
            after = run.prefilled
            if run.prefilled < run.prefill_end:
                n = min(run.chunk, run.prefill_end - run.prefilled)
                prefills.append(PrefillChunk(run.tag, run.prefilled, n))
                after += n
            if after == run.prefill_end:
                if run.sampling == Sampling.HOST:
                    if run.row is not None:
                        commits.append(HostCommit(run.tag, *self._host_pick(run)))
                    decodes.append(LaneDecode(run.tag, 1))
                else:
                    left = self._rounds_left(run)
                    decodes.append(LaneDecode(run.tag, min(run.rounds, left)))
        return TickPlan(self.seq, admits=admits, prefills=prefills, decodes=decodes, commits=commits, retires=retires, **extra)

    def _rounds_left(self, run: LaneRun) -> int:
        replay_left = run.decode_replay - run.replayed
        return run.max_tokens - len(run.out) + max(replay_left, 0)

    def _host_pick(self, run: LaneRun) -> tuple[int, int]:
        nonce, row = run.row
        pos = run.rng_base + len(run.out)
        if run.params.temperature <= 0.0:
            token = hs.argmax(row)
        else:
            token = hs.sample(row.copy(), run.params, hs.uniform(pos))
        run.out.append(token)
        run.row = None
        return token, nonce

    def tick(self, plan: TickPlan | None = None, yield_now: bool = False):
        plan = plan or self.plan()
        self.ex.rings.request_yield(yield_now)
        out = self.ex.run_tick(plan)
        self.ex.rings.request_yield(False)
        assert out.status == Status.OK, Status(out.status).name
        ev = out.events
        self.events.append(ev)
        for a in plan.admits:
            self.lanes[a.lane_tag].admitted = True
        dropped = {}
        for s in ev.shed.entries:
            if s.kind == ShedKind.PREFILL_CHUNK:
                dropped[s.lane_tag] = dropped.get(s.lane_tag, 0) + s.tokens
        for p in plan.prefills:
            self.lanes[p.lane_tag].prefilled += p.token_count - dropped.get(p.lane_tag, 0)
        for f in ev.faults:
            self.lanes[f.lane_tag].fault = f.code
        by_tag = {}
        for lp in ev.logprobs:
            by_tag.setdefault(lp.lane_tag, []).append(lp)
        for e in ev.emits:
            run = self.lanes[e.lane_tag]
            if run.sampling == Sampling.HOST:
                if e.logits_row.length:
                    run.row = (e.logits_row.generation, self.ex.rings.read_logits_row(e.logits_row))
            else:
                toks = self.ex.rings.read_emits(e.token_ref)
                lanes = getattr(self.ex, "lanes", None)  # in-process only: replay bookkeeping
                lane = lanes.get(e.lane_tag) if lanes is not None else None
                # what the executor replayed this tick is the lane's committed growth minus emits
                run.out += toks
                run.logprobs += by_tag.get(e.lane_tag, [])
                if lane is not None:
                    run.replayed = len(lane.committed) - len(run.out) - (len(run.prompt) - run.decode_replay)
                    run.replayed = min(max(run.replayed, 0), run.decode_replay)
            if e.finish:
                run.finish = e.finish
        return ev

    def run(self, max_ticks: int = 500, yield_every: int = 0) -> None:
        for i in range(max_ticks):
            if all(r.done for r in self.lanes.values()):
                return
            self.tick(yield_now=bool(yield_every) and i % yield_every == 0)
        raise AssertionError("lanes did not finish")

    def retire(self, tags, publish: bool = True):
        self.seq += 1
        plan = TickPlan(self.seq, retires=[LaneRetire(t, publish) for t in tags])
        out = self.ex.run_tick(plan)
        assert out.status == Status.OK, Status(out.status).name
        for t in tags:
            self.lanes.pop(t, None)
        return out.events
