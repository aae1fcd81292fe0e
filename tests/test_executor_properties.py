"""Stateful property tests of the executor over the toy runtime.

A model scheduler builds random valid plans (admits with and without seeds, forks
seeded from one entry, adopted sequences, chunked prefills under token budgets,
decodes, host lanes with their commits, retires with and without publishing, exports
and imports between ticks) and after every OK tick checks:

- the runtime's cells are exactly its live sequences' cells, and every live sequence
  belongs to exactly one lane, resident cache entry or bare sequence;
- a lane's sequence holds exactly its ingested committed tokens; an entry's holds its key;
- cache bytes reconcile: resident before - CACHE_EVICTION shed bytes + published
  bytes == resident after;
- pins are never negative and equal the live leases naming each entry;
- each lane's committed tokens are its prompt (so far) followed by what it emitted
  or the host committed.

Random invalid plans (a valid plan with one thing wrong) answer the expected reject
and leave both snapshots as they were. NEEDS_REPLAN is answered by asking again with
eviction allowed, then smaller; OOM_TENTATIVE faults (a tight pool) retire the lane.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from msgspec.structs import replace

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from executor_helpers import cache_view, check_cache_reconciles, check_invariants, state
from superfluid.abi import (
    CacheClass,
    FaultCode,
    Finish,
    HostCommit,
    LaneAdmit,
    LaneDecode,
    LaneRetire,
    PrefillChunk,
    Sampling,
    ShedKind,
    Status,
    TickPlan,
    TickStatus,
)
from superfluid.executor import Executor
from superfluid import sampling as hs
from superfluid.runtimes.base import PrimError
from superfluid.runtimes.toy import _HASH0, ToyRuntime, _mix

EVICT_ALL = dict(evictable_cache_classes=CacheClass.RESIDENT_PREFIX, max_evict_bytes=1 << 40)


@dataclass
class MLane:
    prompt: list[int]
    host: bool
    progress: int  # prompt tokens prefilled (a seed's prefix counts)
    emitted: list[int] = field(default_factory=list)  # decoded, or committed by the host
    finished: bool = False
    nonce: int | None = None  # host lanes: the pending row's generation

    @property
    def prefilled(self) -> bool:
        return self.progress == len(self.prompt)


@dataclass
class Draft:
    """A plan being built, with what the model expects of it."""

    admits: list = field(default_factory=list)
    prefills: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    commits: list = field(default_factory=list)
    retires: list = field(default_factory=list)
    budget: int = 1 << 30
    evict: dict = field(default_factory=dict)
    new: dict = field(default_factory=dict)  # tag -> MLane for admits

    def plan(self, seq: int, **kw) -> TickPlan:
        args = dict(
            plan_seq=seq,
            admits=list(self.admits),
            prefills=list(self.prefills),
            decodes=list(self.decodes),
            commits=list(self.commits),
            retires=list(self.retires),
            prefill_token_budget=self.budget,
            **self.evict,
        )
        args.update(kw)
        return TickPlan(**args)


class ExecutorMachine(RuleBasedStateMachine):
    RT: dict = dict(n_cells=1024, page=4, max_batch=8, max_seq_len=64)
    LONG_PROMPTS = False  # now and then a prompt long enough to checkpoint (recurrent)

    def __init__(self):
        super().__init__()
        self.rt = self.make_runtime()
        self.ex = Executor(self.rt)
        self.rings = self.ex.rings
        self.desc = self.ex.desc
        self.lanes: dict[int, MLane] = {}
        self.faulted: set[int] = set()
        self.next_tag = 1
        self.adopted: list = []  # (lease, tokens) of adopted sequences
        self.stats = dict(ok=0, replans=0, faults=0, evictions=0, seeded=0, rejects=0)

    def make_runtime(self):
        return ToyRuntime(**self.RT)

    def check_row(self, row: np.ndarray, history: list[int]) -> None:
        """A host lane's row is the model's row after its history (bit-exact on the toy)."""
        np.testing.assert_array_equal(row, self.ref_row(history))

    def check_greedy(self, token: int, history: list[int]) -> None:
        assert token == hs.argmax(self.ref_row(history)), (history, token)

    def ref_row(self, history: list[int]) -> np.ndarray:
        """The toy model's row after ``history``, computed afresh: whatever path a lane
        took (seeded, copied, taken over, imported, adopted), its rows are these."""
        h = _HASH0
        for t in history:
            h = _mix(h, t)
        return self.rt.row_for(h, history[-1])

    # ------------------------------------------------------------ drawing
    # Hypothesis picks the rules and one seed per rule; the decisions inside a rule
    # come from that seed, so that they are spread evenly (hypothesis favours zeros).
    def reseed(self, data) -> random.Random:
        self.r = random.Random(data.draw(st.integers(0, (1 << 32) - 1), label="seed"))
        return self.r

    def tokens(self, lo: int = 1, hi: int = 24) -> list[int]:
        r = self.r
        return [r.randrange(3, 130) for _ in range(r.randint(lo, hi))]

    def new_tag(self) -> int:
        t = self.next_tag
        self.next_tag += 1
        return t

    def prompt_for(self) -> tuple[list[int], bool]:
        """A fresh prompt, or one that continues a cached entry (then worth a lease)."""
        r = self.r
        entries = [e for e in self.ex.cache if e.tokens]
        exact = self.desc.exact_only
        from_entry = False
        if entries and r.random() < 0.6:
            e = r.choice(entries)
            n = len(e.tokens) if exact else r.randint(1, len(e.tokens))
            tail = self.tokens(1 if exact else 0, 8) if exact or r.random() < 0.8 else []
            prompt = e.tokens[:n] + tail
            from_entry = True
        elif self.LONG_PROMPTS and r.random() < 0.15:
            prompt = self.tokens(128, 140)
        else:
            prompt = self.tokens()
        return prompt[: self.desc.max_seq_len - 2] or [5], from_entry

    # ------------------------------------------------------------ a valid plan
    def draft(self, admits: bool = True) -> Draft:
        r = self.r
        d = Draft()
        self.rings.begin_prompts()
        for tag in sorted(self.faulted):
            d.retires.append(LaneRetire(tag, r.random() < 0.5))
        retiring = set()
        for tag, m in sorted(self.lanes.items()):
            if r.random() < (0.5 if m.finished else 0.1):
                d.retires.append(LaneRetire(tag, r.random() < 0.6))
                retiring.add(tag)
        work: list[tuple[int, MLane, bool]] = []  # lanes that may prefill / decode, existing first
        for tag, m in sorted(self.lanes.items()):
            if tag in retiring or m.finished:
                continue
            committing = False
            if m.host and m.nonce is not None and r.random() < 0.75:
                tok = r.randrange(0, self.desc.vocab_size)
                d.commits.append(HostCommit(tag, tok, m.nonce))
                committing = True
            work.append((tag, m, committing))
        if admits:
            for _ in range(r.choice([0, 0, 1, 1, 1, 2, 3])):
                self.draw_admit(d, work)
            if r.random() < 0.2:
                self.draw_fork(d, work)
        # prefills, under a budget, then the decodes that the budget allows
        reached: dict[int, int] = {}
        chunks = []
        for tag, m, _ in work:
            left = len(m.prompt) - m.progress
            if left > 0 and r.random() < 0.8:
                count = left if r.random() < 0.5 else r.randint(1, left)
                chunks.append(PrefillChunk(tag, m.progress, count))
        if chunks and r.random() < 0.15:
            d.budget = r.randint(0, sum(c.token_count for c in chunks))
        left = d.budget
        for c in chunks:
            take = min(c.token_count, left)
            left -= take
            reached[c.lane_tag] = c.token_offset + take
        d.prefills = chunks
        for tag, m, committing in work:
            full = reached.get(tag, m.progress) == len(m.prompt)
            if not full:
                continue
            if m.host:
                if m.nonce is not None and not committing:
                    continue
                if r.random() < 0.75:
                    d.decodes.append(LaneDecode(tag, 1))
            elif r.random() < 0.8:
                d.decodes.append(LaneDecode(tag, r.choice([0, 1, 1, 2, 3, 4, 6, 8])))
        if r.random() < 0.4:
            d.evict = dict(
                evictable_cache_classes=CacheClass.RESIDENT_PREFIX,
                max_evict_bytes=r.choice([0, 256, 512, 1024, 1 << 40]),
            )
        return d

    def _lease(self, prompt: list[int]):
        lease = self.ex.lease_prefix(prompt, ttl_ticks=self.r.randint(0, 3))
        if lease is not None:
            assert prompt[: lease.prefix_len] == self.ex.leases[lease.handle].prefix
            if self.desc.exact_only:
                assert lease.prefix_len < len(prompt)
            else:
                assert lease.prefix_len % self.desc.page == 0
        return lease

    def _add_admit(self, d: Draft, work, prompt, host: bool, seed=None) -> None:
        tag = self.new_tag()
        ref = self.rings.write_prompt(prompt)
        sampling = Sampling.HOST if host else Sampling.GREEDY
        n = 0 if seed is None else seed.prefix_len
        d.admits.append(LaneAdmit(tag, ref, sampling=sampling, lease_handle=0 if seed is None else seed.handle))
        m = MLane(prompt, host, n)
        d.new[tag] = m
        work.append((tag, m, False))

    def draw_admit(self, d: Draft, work) -> None:
        r = self.r
        prompt, from_entry = self.prompt_for()
        host = r.random() < 0.2
        seed = None
        if self.adopted and r.random() < 0.3:
            lease, toks = self.adopted.pop(0)
            if lease.handle in self.ex.leases and self.ex.leases[lease.handle].adopted in self.ex.bare:
                prompt = (toks + self.tokens(1, 6))[: self.desc.max_seq_len - 2]
                if len(prompt) > len(toks):
                    seed = lease
        elif r.random() < (0.8 if from_entry else 0.2):
            seed = self._lease(prompt)
        self._add_admit(d, work, prompt, host, seed)

    def draw_fork(self, d: Draft, work) -> None:
        """Several admits seeded from one entry (n-best, or a shared system prompt)."""
        entries = [e for e in self.ex.cache if e.tokens]
        if not entries:
            return
        e = self.r.choice(entries)
        for _ in range(self.r.randint(2, 3)):
            prompt = (e.tokens + self.tokens(1, 6))[: self.desc.max_seq_len - 2]
            self._add_admit(d, work, prompt, False, self._lease(prompt))

    # ------------------------------------------------------------ running
    def run(self, d: Draft) -> None:
        ex = self.ex
        seq = 1 if ex.last_plan_seq is None else ex.last_plan_seq + 1
        before = state(ex)
        cache = cache_view(ex)
        tries = [
            d.plan(seq),
            d.plan(seq, **EVICT_ALL),
            # smaller: no admits, no prefills, no decodes
            d.plan(seq, admits=[], prefills=[], decodes=[], **EVICT_ALL),
            # and no publishing, which needs a cell for a pending token
            d.plan(seq, admits=[], prefills=[], decodes=[], retires=[LaneRetire(r.lane_tag) for r in d.retires], **EVICT_ALL),
        ]
        for i, plan in enumerate(tries):
            out = ex.run_tick(plan)
            if out.status != Status.NEEDS_REPLAN:
                break
            self.stats["replans"] += 1
            assert state(ex) == before, "NEEDS_REPLAN changed state"
        assert Status(out.status) == Status.OK, (Status(out.status).name, plan)
        self.stats["ok"] += 1
        self.absorb(plan, d, out)
        check_invariants(ex)
        check_cache_reconciles(cache, ex, out)
        self.check_lanes()

    def absorb(self, plan: TickPlan, d: Draft, out) -> None:
        ev = out.events
        assert ev.plan_seq == plan.plan_seq
        # retires
        for r in plan.retires:
            self.lanes.pop(r.lane_tag, None)
            self.faulted.discard(r.lane_tag)
        # commits
        for c in plan.commits:
            m = self.lanes[c.lane_tag]
            m.emitted.append(c.token_id)
            m.nonce = None
        # admits
        assert [a.lane_tag for a in ev.admit_results] == [a.lane_tag for a in plan.admits]
        assert all(a.status == 0 and a.granted_class == 1 for a in ev.admit_results)
        for a in plan.admits:
            self.lanes[a.lane_tag] = d.new[a.lane_tag]
            if a.lease_handle:
                self.stats["seeded"] += 1
        # prefill: the budget's cut is a shed chunk
        left = plan.prefill_token_budget
        dropped = {}
        for p in plan.prefills:
            take = min(p.token_count, left)
            left -= take
            if p.token_count > take:
                dropped[p.lane_tag] = p.token_count - take
            self.lanes[p.lane_tag].progress += take
        shed_chunks = {s.lane_tag: s.tokens for s in ev.shed.entries if s.kind == ShedKind.PREFILL_CHUNK}
        assert shed_chunks == dropped
        assert ev.shed.prefill_chunks_dropped == len(dropped)
        # faults: only a tight pool's
        for f in ev.faults:
            assert f.code == FaultCode.OOM_TENTATIVE, f
            self.lanes.pop(f.lane_tag, None)
            self.faulted.add(f.lane_tag)
            self.stats["faults"] += 1
        assert (ev.tick_status == TickStatus.LANE_ERRORS) == bool(ev.faults)
        if not ev.faults:
            shed = bool(ev.shed.entries)
            assert ev.tick_status == (TickStatus.SHED if shed else TickStatus.OK)
        self.stats["evictions"] += ev.shed.evictions_performed
        # emits
        emits = {e.lane_tag: e for e in ev.emits}
        for dec in plan.decodes:
            if dec.lane_tag in self.faulted:
                assert dec.lane_tag not in emits
                continue
            m = self.lanes[dec.lane_tag]
            e = emits[dec.lane_tag]
            if e.finish != Finish.NONE:
                m.finished = True
            if m.host:
                assert e.n_tokens == 0
                if dec.max_new_tokens and e.finish == Finish.NONE:
                    assert e.logits_row.length == 1
                    row = self.rings.read_logits_row(e.logits_row)
                    assert row.shape == (self.desc.vocab_size,) and np.isfinite(row).all()
                    self.check_row(row, m.prompt + m.emitted)
                    m.nonce = e.logits_row.generation
                continue
            toks = self.rings.read_emits(e.token_ref)
            assert len(toks) == e.n_tokens
            assert all(0 <= t < self.desc.vocab_size for t in toks)
            for t in toks:  # greedy: each token is the argmax of the history's row
                self.check_greedy(t, m.prompt + m.emitted)
                m.emitted.append(t)
            if e.finish == Finish.NONE:
                assert len(toks) == dec.max_new_tokens
            elif e.finish == Finish.EOS:
                assert toks and self.rt.is_eos(toks[-1])
            elif e.finish == Finish.LENGTH:
                assert len(m.prompt) + len(m.emitted) >= self.desc.max_seq_len
        assert set(emits) == {dd.lane_tag for dd in plan.decodes} - self.faulted

    def check_lanes(self) -> None:
        ex, rt = self.ex, self.rt
        assert set(ex.lanes) == set(self.lanes)
        assert ex.faulted == self.faulted
        for tag, m in self.lanes.items():
            committed = ex.lane_tokens(tag)
            assert committed == m.prompt[: m.progress] + m.emitted, tag
            assert len(committed) <= self.desc.max_seq_len
            lane = ex.lanes[tag]
            s = rt.seqs[lane.seq]
            n = lane.ingested()
            if self.desc.exact_only:
                assert s.state[2] == n
            else:
                # the runtime holds exactly what the lane ingested
                assert s.tokens == committed[:n], tag
        for e in ex.cache.resident():
            s = rt.seqs[e.seq]
            if self.desc.exact_only:
                assert s.state[2] == len(e.tokens)
            else:
                assert s.tokens[: len(e.tokens)] == e.tokens

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def tick(self, data):
        self.reseed(data)
        self.run(self.draft())

    @rule(data=st.data())
    def tick_without_admits(self, data):
        self.reseed(data)
        self.run(self.draft(admits=False))

    @rule(data=st.data())
    def invalid_plan(self, data):
        """A valid plan with one thing wrong: the expected reject, nothing changed."""
        r = self.reseed(data)
        d = self.draft()
        ex = self.ex
        seq = 1 if ex.last_plan_seq is None else ex.last_plan_seq + 1
        unknown = self.next_tag + 1000
        kinds = ["unknown_decode", "unknown_retire", "unknown_prefill", "budget"]
        if ex.last_plan_seq is not None:
            kinds.append("plan_seq")
        if d.prefills:
            kinds += ["wrong_offset", "past_end"]
        if d.admits:
            kinds += ["stale_ref", "ref_oob", "bad_prompt_token", "dup_admit", "long_prompt"]
        if d.commits:
            kinds += ["stale_nonce", "bad_commit_token"]
        hosts_idle = [t for t, m in self.lanes.items() if m.host and m.nonce is None and not m.finished and m.prefilled]
        if hosts_idle:
            kinds.append("host_two")
        pending = [
            t for t, m in self.lanes.items() if m.host and m.nonce is not None and not m.finished
            and t not in {c.lane_tag for c in d.commits} and t not in {r.lane_tag for r in d.retires}
        ]
        if pending:
            kinds.append("uncommitted_row")
        busy = {p.lane_tag for p in d.prefills} | {x.lane_tag for x in d.decodes} | {r.lane_tag for r in d.retires}
        unprefilled = [t for t, m in self.lanes.items() if not m.prefilled and t not in busy]
        if unprefilled:
            kinds.append("decode_unprefilled")
        decoding_lanes = [x for x in d.decodes if x.lane_tag in self.lanes]
        if decoding_lanes:
            kinds.append("retire_decoding")
        seeded = [a for a in d.admits if a.lease_handle]
        if seeded:
            kinds += ["seed_twice", "seed_class"]
        kind = r.choice(kinds)
        bad, expect = self.mutate(d, seq, kind, unknown, hosts_idle, pending, unprefilled)
        before = state(ex)
        out = ex.run_tick(bad)
        assert Status(out.status) == expect, (kind, Status(out.status).name, bad)
        assert out.events is None
        assert state(ex) == before
        self.stats["rejects"] += 1
        # the plan as drafted, with the same plan_seq, runs
        self.run(d)

    def mutate(self, d: Draft, seq, kind, unknown, hosts_idle, pending, unprefilled):
        S = Status
        if kind == "unknown_decode":
            return d.plan(seq, decodes=d.decodes + [LaneDecode(unknown, 1)]), S.REJECT_UNKNOWN_LANE
        if kind == "unknown_retire":
            return d.plan(seq, retires=d.retires + [LaneRetire(unknown, True)]), S.REJECT_UNKNOWN_LANE
        if kind == "unknown_prefill":
            return d.plan(seq, prefills=d.prefills + [PrefillChunk(unknown, 0, 1)]), S.REJECT_UNKNOWN_LANE
        if kind == "budget":
            return d.plan(seq, max_decode_lanes=self.desc.max_batch + 1), S.REJECT_BUDGET
        r = self.r
        if kind == "plan_seq":
            return d.plan(self.ex.last_plan_seq - r.randint(0, 2)), S.REJECT_ILLEGAL_COMBINATION
        r = self.r
        i = r.randrange(1 << 10)
        if kind in ("wrong_offset", "past_end"):
            ps = list(d.prefills)
            p = ps[i % len(ps)]
            m = self.lanes.get(p.lane_tag) or d.new[p.lane_tag]
            if kind == "wrong_offset":
                off = p.token_offset + 1 if p.token_offset == 0 or r.random() < 0.5 else p.token_offset - 1
                ps[i % len(ps)] = PrefillChunk(p.lane_tag, off, p.token_count)
                return d.plan(seq, prefills=ps), S.REJECT_ILLEGAL_COMBINATION
            ps[i % len(ps)] = PrefillChunk(p.lane_tag, p.token_offset, len(m.prompt) - p.token_offset + 1)
            return d.plan(seq, prefills=ps), S.REJECT_BOUNDS
        if kind in ("stale_ref", "ref_oob", "bad_prompt_token", "dup_admit", "long_prompt", "seed_twice", "seed_class"):
            ad = list(d.admits)
            j = i % len(ad)
            a = ad[j]

            def without(lane: int) -> dict:
                """The plan's prefills and decodes minus those of one lane."""
                return dict(prefills=[p for p in d.prefills if p.lane_tag != lane],
                            decodes=[x for x in d.decodes if x.lane_tag != lane])

            if kind == "stale_ref":
                ad[j] = replace(a, prompt=replace(a.prompt, generation=a.prompt.generation - 1))
                return d.plan(seq, admits=ad), S.REJECT_BAD_REF_GENERATION
            if kind == "ref_oob":
                ad[j] = replace(a, prompt=replace(a.prompt, length=a.prompt.length + 1 << 20))
                return d.plan(seq, admits=ad), S.REJECT_BOUNDS
            if kind == "bad_prompt_token":
                toks = self.rings.read_tokens(a.prompt)
                toks[r.randrange(len(toks))] = self.desc.vocab_size + r.randint(0, 5)
                ad[j] = replace(a, prompt=self.rings.write_prompt(toks))
                return d.plan(seq, admits=ad), S.REJECT_BOUNDS
            if kind == "dup_admit":
                other = r.choice(sorted(self.lanes) or [a.lane_tag])
                if other == a.lane_tag:
                    ad.append(a)
                else:
                    ad[j] = replace(a, lane_tag=other)
                    # keep the rest of the plan about the renamed admit consistent
                    return d.plan(seq, admits=ad, **without(a.lane_tag)), S.REJECT_ILLEGAL_COMBINATION
                return d.plan(seq, admits=ad), S.REJECT_ILLEGAL_COMBINATION
            if kind == "long_prompt":
                ad[j] = replace(a, prompt=self.rings.write_prompt([7] * (self.desc.max_seq_len + 1)), lease_handle=0)
                return d.plan(seq, admits=ad, **without(a.lane_tag)), S.REJECT_BUDGET
            seeded = [k for k, x in enumerate(ad) if x.lease_handle]
            k = seeded[i % len(seeded)]
            a = ad[k]
            if kind == "seed_class":
                ad[k] = replace(a, determinism_class=a.determinism_class + 1)
                return d.plan(seq, admits=ad), S.REJECT_STALE_LEASE
            ad.append(replace(a, lane_tag=self.new_tag()))
            return d.plan(seq, admits=ad), S.REJECT_STALE_LEASE
        if kind in ("stale_nonce", "bad_commit_token"):
            cs = list(d.commits)
            c = cs[i % len(cs)]
            if kind == "stale_nonce":
                cs[i % len(cs)] = replace(c, logits_nonce=c.logits_nonce + r.choice([-1, 1, 7]))
                return d.plan(seq, commits=cs), S.REJECT_STALE_NONCE
            cs[i % len(cs)] = replace(c, token_id=self.desc.vocab_size + i % 3)
            return d.plan(seq, commits=cs), S.REJECT_BOUNDS
        if kind == "host_two":
            t = hosts_idle[i % len(hosts_idle)]
            decs = [x for x in d.decodes if x.lane_tag != t] + [LaneDecode(t, 2)]
            rets = [r for r in d.retires if r.lane_tag != t]
            return d.plan(seq, decodes=decs, retires=rets), S.REJECT_HOST_RULES
        if kind == "uncommitted_row":
            t = pending[i % len(pending)]
            return d.plan(seq, decodes=d.decodes + [LaneDecode(t, 1)]), S.REJECT_HOST_RULES
        if kind == "decode_unprefilled":
            t = unprefilled[i % len(unprefilled)]
            n = 1 if self.lanes[t].host else 1 + i % 4
            return d.plan(seq, decodes=d.decodes + [LaneDecode(t, n)]), S.REJECT_ILLEGAL_COMBINATION
        if kind == "retire_decoding":
            xs = [x for x in d.decodes if x.lane_tag in self.lanes]
            x = xs[i % len(xs)]
            return d.plan(seq, retires=d.retires + [LaneRetire(x.lane_tag)]), S.REJECT_ILLEGAL_COMBINATION
        raise AssertionError(kind)

    @rule(data=st.data())
    def adopt(self, data):
        """Bring a cached entry's export back in as a bare sequence, leased for an admit."""
        entries = self.ex.cache.resident()
        if not entries:
            return
        e = entries[data.draw(st.integers(0, len(entries) - 1), label="adopt entry")]
        payload = self.rt.seq_export(e.seq)
        try:
            lease = self.ex.adopt(list(e.tokens), payload, ttl_ticks=data.draw(st.integers(0, 3)))
        except PrimError:
            check_invariants(self.ex)
            return
        self.adopted.append((lease, list(e.tokens)))
        check_invariants(self.ex)

    @rule()
    def export_entries(self):
        self.ex.export_entries()
        check_invariants(self.ex)

    @rule()
    def import_entries(self):
        self.ex.import_entries()
        check_invariants(self.ex)

    @rule(data=st.data())
    def release_a_lease(self, data):
        free = [h for h, s in self.ex.leases.items()]
        if free:
            self.ex.release_lease(free[data.draw(st.integers(0, len(free) - 1))])
            check_invariants(self.ex)

    @invariant()
    def memory_invariants(self):
        check_invariants(self.ex)


SETTINGS = settings(
    max_examples=30,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    derandomize=True,
)


class PlainMachine(ExecutorMachine):
    RT = dict(n_cells=1024, page=4, max_batch=8, max_seq_len=64)


class SharedCellsMachine(ExecutorMachine):
    RT = dict(n_cells=256, page=4, max_batch=8, max_seq_len=64, copy_shares_cells=True)


class RecurrentMachine(ExecutorMachine):
    RT = dict(page=4, max_batch=8, max_seq_len=160, exact_only=True, max_seqs=8)
    LONG_PROMPTS = True


class SmallPoolMachine(ExecutorMachine):
    RT = dict(n_cells=96, page=4, max_batch=4, max_seq_len=48, prefill_step_tokens=8)


class TinyPoolMachine(ExecutorMachine):
    RT = dict(n_cells=64, page=2, max_batch=8, max_seq_len=40)


class TakeoverMachine(ExecutorMachine):
    RT = dict(n_cells=192, page=4, max_batch=8, max_seq_len=64, takeover_preferred=True)


def _case(machine):
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestPlain = _case(PlainMachine)
TestSharedCells = _case(SharedCellsMachine)
TestRecurrent = _case(RecurrentMachine)
TestSmallPool = _case(SmallPoolMachine)
TestTinyPool = _case(TinyPoolMachine)
TestTakeover = _case(TakeoverMachine)
