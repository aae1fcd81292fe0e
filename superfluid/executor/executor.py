"""The executor: lanes, the prefix cache, seeds and strategies over one runtime.

``run_tick(plan)`` is the whole contract (see tick.py): validate everything, change
nothing on a reject; then carry the plan out. The operations below it (leases,
adoption, biases, grammars, strategies, fault injection, exports) run between ticks
and report in the next tick's ``op_completions`` where they complete something.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..abi import FaultCode, OpCompletion, OpKind, Status, TickOutcome, TickPlan
from ..rings import Rings
from ..runtimes.base import Fatal, PrimError, RuntimePrimitives
from .cache import CacheEntry, PrefixCache, Retention
if TYPE_CHECKING:
    from .grammar import GrammarStore
from .lane import Lane
from .speculate import SpecConfig, SpecGate

FATAL_EXIT_STATUS = 70


def fatal_exits() -> bool:
    """A worker process exits on a fatal runtime error so its supervisor starts a clean one."""
    return os.environ.get("SUPERFLUID_FATAL_EXIT") == "1"


@dataclass
class SeedLease:
    handle: int
    entry_id: int  # the cache entry it pins (0 when adopted)
    prefix: list[int]
    expires_at_tick: int
    determinism: int
    adopted: int | None = None  # a bare runtime sequence this lease hands to its admit
    taken_seq: int | None = None  # this tick's take-over: the entry's sequence, now the lane's

    @property
    def prefix_len(self) -> int:
        return len(self.prefix)


@dataclass(frozen=True)
class ExecutorConfig:
    cache_max_fraction: float = 0.9  # resident cache bytes kept under this share of the pool
    host_cache_bytes: int = 64 << 20  # entries leaving the pool are exported while this holds them
    host_cache_entries: int = 256  # ... and while there are fewer exported entries than this
    fatal_exit: bool | None = None  # None: from SUPERFLUID_FATAL_EXIT


class Executor:
    def __init__(self, runtime: RuntimePrimitives, rings: Rings | None = None, config: ExecutorConfig = ExecutorConfig()):
        self.prim = runtime
        self.desc = runtime.desc
        self.rings = rings if rings is not None else Rings(runtime.desc.vocab_size)
        self.config = config
        self.lanes: dict[int, Lane] = {}
        self.faulted: set[int] = set()  # lanes that faulted and await their retire
        self.cache = PrefixCache()
        self.seeds: dict[int, SeedLease] = {}
        self.bare: set[int] = set()  # adopted sequences awaiting their admit
        self.biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._grammars: GrammarStore | None = None  # made on first use: xgrammar is slow to import
        self.strategy: SpecConfig | None = None
        self.strategy_slot = 0
        self.spec_gate = SpecGate()
        self.inject_faults: dict[int, int] = {}
        self.completions_pending: list[OpCompletion] = []
        self.penalty_exempt: frozenset[int] | None = None
        self.prefill_secs_per_token: float | None = None
        self.last_plan_seq: int | None = None
        self.tick_count = 0
        self.protected_quota = 0  # the last accepted plan's protected_quota_bytes (keyed entries)
        self._next_handle = 1

    # ------------------------------------------------------------------ tick
    def run_tick(self, plan: TickPlan, on_partial_emit: Callable[[int, int], None] | None = None) -> TickOutcome:
        from .tick import run_tick

        return run_tick(self, plan, on_partial_emit)

    def fatal(self, during: str) -> Status:
        exits = self.config.fatal_exit if self.config.fatal_exit is not None else fatal_exits()
        if exits:
            print(
                f"superfluid: the {self.desc.runtime_id} runtime failed in {during}; "
                "this worker exits so that the daemon starts a clean one",
                file=sys.stderr,
                flush=True,
            )
            os._exit(FATAL_EXIT_STATUS)
        return Status.FATAL

    @property
    def grammars(self) -> "GrammarStore | None":
        if self._grammars is None:
            vocab = self.prim.vocabulary()
            if vocab is None:
                return None
            from .grammar import GrammarStore

            self._grammars = GrammarStore(vocab, self.desc.vocab_size)
        return self._grammars

    # -------------------------------------------------------------- helpers
    def _handle(self) -> int:
        h = self._next_handle
        self._next_handle += 1
        return h

    def page(self) -> int:
        return max(self.desc.page, 1)

    def entry_bytes(self, n_tokens: int) -> int:
        if self.desc.exact_only:
            return self.desc.cell_bytes  # a recurrent state's size does not grow
        return n_tokens * self.desc.cell_bytes

    def live_sequences(self) -> int:
        return len(self.lanes) + len(self.cache.resident()) + len(self.bare)

    def pool_bytes(self) -> int:
        return self.prim.mem_counters().cells_total * self.desc.cell_bytes

    def host_room(self, nbytes: int, retention: int = Retention.NONE) -> bool:
        # Host memory is kept least-recently-used, 24h entries last: an entry leaving the
        # pool counts only against the 24h entries there, and settle_cache then drops the
        # oldest others until the budget holds.
        return self.cache.exported_bytes(Retention.EXTENDED) + nbytes <= self.config.host_cache_bytes

    def protected(self) -> frozenset[int]:
        return self.cache.protected(self.protected_quota)

    def leave_pool(self, e: CacheEntry, evicted: list[tuple[int, int]]) -> None:
        """An entry leaves the pool: exported where host memory has room, else dropped.
        Either way its cells go back, so either way it is a shed entry."""
        evicted.append((e.bytes, len(e.tokens)))
        seq = e.seq
        assert seq is not None
        payload = None
        if self.host_room(e.bytes, e.retention):
            try:
                payload = self.prim.seq_export(seq)
            except PrimError as err:
                if isinstance(err, Fatal):
                    raise  # run_tick takes the fatal path
                payload = None  # dropped instead of exported
        self.prim.seq_free(seq)
        if payload is None:
            self.cache.remove(e.entry_id)
        else:
            e.seq, e.exported = None, payload

    def settle_cache(self, evicted: list[tuple[int, int]]) -> None:
        """Keep the resident cache under its share of the pool, LRU first."""
        cap = int(self.pool_bytes() * self.config.cache_max_fraction)
        if cap <= 0:
            return
        for e in self.cache.eviction_order(self.protected()):
            if self.cache.resident_bytes() <= cap:
                break
            self.leave_pool(e, evicted)
        # exported entries past the host budget go for good: 24h entries last, then
        # least recently used first
        olds = sorted((e for e in self.cache if e.seq is None and e.pins == 0),
                      key=lambda e: (e.retention == Retention.EXTENDED, e.last_used, e.entry_id))
        exported = [e for e in self.cache if e.seq is None]
        nbytes, count = sum(e.bytes for e in exported), len(exported)
        for e in olds:
            if nbytes <= self.config.host_cache_bytes and count <= self.config.host_cache_entries:
                break
            self.cache.remove(e.entry_id)
            nbytes, count = nbytes - e.bytes, count - 1

    def sweep_expired_seeds(self) -> None:
        for h, lease in list(self.seeds.items()):
            if lease.expires_at_tick < self.tick_count:
                self._drop_lease(h)

    def _drop_lease(self, handle: int) -> None:
        lease = self.seeds.pop(handle)
        if lease.adopted is not None:
            if lease.adopted in self.bare:
                self.bare.discard(lease.adopted)
                self.prim.seq_free(lease.adopted)
        else:
            e = self.cache.get(lease.entry_id)
            if e is not None:
                e.pins = max(e.pins - 1, 0)

    # ------------------------------------------------- operations between ticks
    def lease_seed(self, prompt: list[int], ttl_ticks: int = 4, determinism_class: int = 0,
                   cache_key: int = 0) -> SeedLease | None:
        """Pin the cache entry sharing the longest prefix with the prompt (whole pages;
        exact and shorter than the prompt on a recurrent runtime) until tick_count + ttl.
        A keyed prompt looks among its key's entries first."""
        found = self.cache.longest_prefix(list(prompt), self.page(), self.desc.exact_only, cache_key)
        if found is None:
            return None
        e, n = found
        e.pins += 1
        lease = SeedLease(self._handle(), e.entry_id, list(prompt[:n]), self.tick_count + ttl_ticks, determinism_class)
        self.seeds[lease.handle] = lease
        self.completions_pending.append(OpCompletion(OpKind.LEASE, lease.handle, 0, n))
        return lease

    def release_seed(self, handle: int) -> None:
        if handle in self.seeds:
            self._drop_lease(handle)

    def adopt(self, tokens: list[int], payload: object, ttl_ticks: int = 4, determinism_class: int = 0) -> SeedLease:
        """Bring in a sequence from elsewhere (an export) as a bare sequence, leased for
        the admit whose prompt starts with ``tokens``."""
        seq = self.prim.seq_create()
        try:
            n = self.prim.seq_import(seq, payload)
        except PrimError:
            self.prim.seq_free(seq)
            raise
        if n != len(tokens):
            self.prim.seq_free(seq)
            raise ValueError(f"the payload holds {n} tokens, not {len(tokens)}")
        self.bare.add(seq)
        lease = SeedLease(self._handle(), 0, list(tokens), self.tick_count + ttl_ticks, determinism_class, adopted=seq)
        self.seeds[lease.handle] = lease
        self.completions_pending.append(OpCompletion(OpKind.ADOPT, lease.handle, 0, n))
        return lease

    def register_logit_bias(self, bias: dict[int, float]) -> int:
        ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        if ids.size and (ids.min() < 0 or ids.max() >= self.desc.vocab_size):
            raise ValueError("logit_bias names a token outside the vocabulary")
        vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        h = self._handle()
        self.biases[h] = (ids, vals)
        return h

    def release_logit_bias(self, handle: int) -> None:
        self.biases.pop(handle, None)

    def compile_grammar(self, kind: str, source: str | None = None) -> int:
        if self.grammars is None:
            raise ValueError(f"the {self.desc.runtime_id} runtime has no vocabulary for grammars")
        h = self.grammars.compile(kind, source)
        self.completions_pending.append(OpCompletion(OpKind.GRAMMAR, h))
        return h

    def release_grammar(self, handle: int) -> None:
        if self.grammars is not None:
            self.grammars.release(handle)

    def load_strategy(self, cfg: SpecConfig = SpecConfig()) -> int:
        """Load a speculative strategy; lanes opt in with its slot. Loading anew
        restarts the gate's measurements."""
        self.strategy = cfg
        self.strategy_slot += 1
        self.spec_gate = SpecGate()
        self.completions_pending.append(OpCompletion(OpKind.STRATEGY, self.strategy_slot, 0, cfg.cert_id))
        return self.strategy_slot

    def inject_fault(self, lane_tag: int, code: int = FaultCode.INJECTED) -> None:
        """The lane faults with this code at its next decode (tests)."""
        self.inject_faults[lane_tag] = code

    def export_entries(self, entry_ids: list[int] | None = None) -> list[int]:
        """Move unpinned resident entries out of the pool to host memory."""
        done = []
        for e in list(self.cache):
            if e.seq is None or e.pins or (entry_ids is not None and e.entry_id not in entry_ids):
                continue
            if not self.host_room(e.bytes):
                break
            try:
                payload = self.prim.seq_export(e.seq)
            except PrimError:
                self.completions_pending.append(OpCompletion(OpKind.EXPORT, e.entry_id, 1))
                continue
            self.prim.seq_free(e.seq)
            e.seq, e.exported = None, payload
            done.append(e.entry_id)
            self.completions_pending.append(OpCompletion(OpKind.EXPORT, e.entry_id, 0, e.bytes))
        return done

    def import_entries(self, entry_ids: list[int] | None = None) -> list[int]:
        """Bring exported entries back into the pool where they fit."""
        done = []
        for e in list(self.cache):
            if e.seq is not None or (entry_ids is not None and e.entry_id not in entry_ids):
                continue
            try:
                seq = self.prim.seq_create()
            except PrimError:
                break
            try:
                n = self.prim.seq_import(seq, e.exported)
            except PrimError:
                self.prim.seq_free(seq)
                self.completions_pending.append(OpCompletion(OpKind.IMPORT, e.entry_id, 1))
                continue
            if n != len(e.tokens):
                self.prim.seq_free(seq)
                self.completions_pending.append(OpCompletion(OpKind.IMPORT, e.entry_id, 1))
                continue
            e.seq, e.exported = seq, None
            done.append(e.entry_id)
            self.completions_pending.append(OpCompletion(OpKind.IMPORT, e.entry_id, 0, e.bytes))
        return done

    def cache_classes(self) -> list:
        """Per retention class: resident, protected and exported bytes (metrics)."""
        from ..abi import CacheClassBytes

        protected = self.protected()
        out = []
        for r in (Retention.NONE, Retention.IN_MEMORY, Retention.EXTENDED):
            es = [e for e in self.cache if e.retention == r]
            out.append(CacheClassBytes(
                r, sum(e.bytes for e in es if e.seq is not None),
                sum(e.bytes for e in es if e.entry_id in protected), sum(e.bytes for e in es if e.seq is None)))
        return out

    def export_prefix(self, tokens: list[int]) -> tuple[list[int], object] | None:
        """A copy of the state of the longest cached prefix of ``tokens`` (whole pages;
        exact on a recurrent runtime), as (its tokens, a runtime payload) that another
        executor can ``adopt``: how a draining replica hands a request's KV over. The
        entry stays in this cache; None when nothing is cached or the export fails."""
        found = self.cache.longest_prefix(list(tokens), self.page(), self.desc.exact_only)
        if found is None:
            return None
        e, n = found
        if n != len(e.tokens):  # a payload holds its whole entry, which runs past these tokens
            return None
        try:
            payload = e.exported if e.seq is None else self.prim.seq_export(e.seq)
        except PrimError:
            return None
        return list(e.tokens), payload

    def lane_tokens(self, lane_tag: int) -> list[int] | None:
        lane = self.lanes.get(lane_tag)
        return None if lane is None else list(lane.committed)

    def snapshot(self) -> tuple:
        """Every bit of executor state a rejected plan must leave as it was (tests)."""
        lanes = {
            tag: (
                l.seq, tuple(l.committed), l.pending_input, l.pending_logits, l.prefilled, l.prefill_end,
                l.rng_counter, l.finished, None if l.spec is None else (l.spec.depth, l.spec.misses, l.spec.resting),
            )
            for tag, l in self.lanes.items()
        }
        cache = tuple(
            (e.entry_id, e.seq, tuple(e.tokens), e.prompt, e.bytes, e.last_used, e.pins, e.exported is None, e.shared, e.seeded)
            for e in self.cache
        )
        seeds = {h: (s.entry_id, tuple(s.prefix), s.expires_at_tick, s.adopted) for h, s in self.seeds.items()}
        grammars = None if self._grammars is None else dict(self._grammars.handles())
        return (
            lanes, frozenset(self.faulted), cache, seeds, frozenset(self.bare), frozenset(self.biases),
            dict(self.inject_faults), self.last_plan_seq, self.tick_count, grammars,
            tuple(self.rings.rings[r].generation for r in sorted(self.rings.rings)),
        )
