"""The executor: lanes, the prefix cache, leases and strategies over one runtime.

``run_tick(plan)`` is the whole contract (see tick.py): validate everything, change
nothing on a reject; then carry the plan out. The operations below it (leases,
adoption, biases, grammars, strategies, fault injection, exports) run between ticks
and report in the next tick's ``op_completions`` where they complete something.
The state lives in a TickContext (context.py); the tick's phases get that, never this.
"""

from __future__ import annotations

import os
import sys
import numpy as np

from ..abi import CacheClassBytes, FaultCode, Lease, OpCompletion, OpKind, PartialEmitCallback, Status, TickOutcome, TickPlan
from ..rings import Rings
from ..runtimes.base import RuntimePrimitives
from .cache import PrefixCache
from .context import TickContext
from .lane import Lane
from .leases import HeldLease
from .pool import ExecutorConfig
from .speculate import SpecConfig, SpecGate
from .token_rules import TokenRules
from .tick import run_tick

FATAL_EXIT_STATUS = 70

__all__ = ["Executor", "ExecutorConfig", "FATAL_EXIT_STATUS", "fatal_exits"]


def fatal_exits() -> bool:
    """A worker process exits on a fatal runtime error so its supervisor starts a clean one."""
    return os.environ.get("SUPERFLUID_FATAL_EXIT") == "1"


class Executor:
    def __init__(self, runtime: RuntimePrimitives, rings: Rings | None = None, config: ExecutorConfig = ExecutorConfig()):
        self.prim = runtime
        self.desc = runtime.desc
        self.rings = rings if rings is not None else Rings(runtime.desc.vocab_size)
        self.config = config
        self.ctx = TickContext(runtime, self.rings, config, self.fatal)

    # ------------------------------------------------------------------ tick
    def run_tick(self, plan: TickPlan, on_partial_emit: PartialEmitCallback | None = None) -> TickOutcome:
        return run_tick(self.ctx, plan, on_partial_emit)

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

    # ------------------------------------------------------- state, read-only views
    @property
    def lanes(self) -> dict[int, Lane]:
        return self.ctx.lanes

    @property
    def faulted(self) -> set[int]:
        return self.ctx.faulted

    @property
    def cache(self) -> PrefixCache:
        return self.ctx.pool.cache

    @property
    def leases(self) -> dict[int, HeldLease]:
        return self.ctx.leases.live

    @property
    def bare(self) -> set[int]:
        return self.ctx.leases.bare

    @property
    def tick_count(self) -> int:
        return self.ctx.tick_count

    @property
    def last_plan_seq(self) -> int | None:
        return self.ctx.last_plan_seq

    @property
    def strategy_slot(self) -> int:
        return self.ctx.spec.slot

    @property
    def spec_gate(self) -> SpecGate:
        return self.ctx.spec.gate

    @property
    def prefill_secs_per_token(self) -> float | None:
        return self.ctx.pace.prefill_secs_per_token

    # ------------------------------------------------- operations between ticks
    def lease_prefix(self, prompt: list[int], ttl_ticks: int = 4, determinism_class: int = 0,
                   cache_key: int = 0) -> Lease | None:
        """Pin the cache entry sharing the longest prefix with the prompt until
        tick_count + ttl (leases.py says which prefix)."""
        c = self.ctx
        held = c.leases.lease(prompt, c.pool.page, self.desc.exact_only, c.tick_count + ttl_ticks,
                              determinism_class, cache_key, c.done_ops)
        return None if held is None else Lease(held.handle, held.prefix_len)

    def release_lease(self, handle: int) -> None:
        self.ctx.leases.release(handle)

    def adopt(self, tokens: list[int], payload: object, ttl_ticks: int = 4, determinism_class: int = 0) -> Lease:
        """Bring in a sequence from elsewhere (an export) as a bare sequence, leased for
        the admit whose prompt starts with ``tokens``."""
        c = self.ctx
        held = c.leases.adopt(tokens, payload, c.tick_count + ttl_ticks, determinism_class, c.done_ops)
        return Lease(held.handle, held.prefix_len)

    def register_logit_bias(self, bias: dict[int, float]) -> int:
        ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
        if ids.size and (ids.min() < 0 or ids.max() >= self.desc.vocab_size):
            raise ValueError("logit_bias names a token outside the vocabulary")
        vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        h = next(self.ctx.handles)
        self.ctx.biases[h] = (ids, vals)
        return h

    def release_logit_bias(self, handle: int) -> None:
        self.ctx.biases.pop(handle, None)

    def register_token_rules(self, allowed: list[int] | None, bad_words: list[list[int]], min_tokens: int,
                             min_ban: list[int]) -> int:
        vocab = self.ctx.prim.vocabulary()
        ban = list(min_ban) + (list(vocab.eos) if vocab is not None else [])  # this runtime's EOS too
        rules = TokenRules.build(self.desc.vocab_size, allowed, bad_words, min_tokens, ban)
        h = next(self.ctx.handles)
        self.ctx.rules[h] = rules
        return h

    def release_token_rules(self, handle: int) -> None:
        self.ctx.rules.pop(handle, None)

    def compile_grammar(self, kind: str, source: str | None = None, wait: bool = True) -> int:
        store = self.ctx.grammars.store
        if store is None:
            raise ValueError(f"the {self.desc.runtime_id} runtime has no vocabulary for grammars")
        h = store.compile(kind, source, wait)
        self.ctx.done_ops.append(OpCompletion(OpKind.GRAMMAR, h))
        return h

    def grammar_states(self, handles: list[int]) -> list[tuple[int, str]]:
        store = self.ctx.grammars.made
        if store is None:
            return [(2, f"grammar handle {h} is not live") for h in handles]
        return store.states(handles)

    def release_grammar(self, handle: int) -> None:
        self.ctx.grammars.release(handle)

    def load_strategy(self, cfg: SpecConfig = SpecConfig()) -> int:
        """Load a speculative strategy; lanes opt in with its slot. Loading anew
        restarts the gate's measurements."""
        spec = self.ctx.spec
        spec.config, spec.slot, spec.gate = cfg, spec.slot + 1, SpecGate()
        self.ctx.done_ops.append(OpCompletion(OpKind.STRATEGY, spec.slot, 0, cfg.cert_id))
        return spec.slot

    def inject_fault(self, lane_tag: int, code: int = FaultCode.INJECTED) -> None:
        """The lane faults with this code at its next decode (tests)."""
        self.ctx.injected[lane_tag] = code

    def export_entries(self, entry_ids: list[int] | None = None) -> list[int]:
        """Move unpinned resident entries out of the pool to host memory."""
        return self.ctx.pool.export_entries(entry_ids, self.ctx.done_ops)

    def import_entries(self, entry_ids: list[int] | None = None) -> list[int]:
        """Bring exported entries back into the pool where they fit."""
        return self.ctx.pool.import_entries(entry_ids, self.ctx.done_ops)

    def cache_classes(self) -> list[CacheClassBytes]:
        """Per retention class: resident, protected and exported bytes (metrics)."""
        return self.ctx.pool.classes()

    def export_prefix(self, tokens: list[int]) -> tuple[list[int], object] | None:
        """A copy of the state of the longest cached prefix of ``tokens`` that another
        executor can ``adopt``: how a draining replica hands a request's KV over."""
        return self.ctx.pool.export_prefix(tokens)

    def lane_tokens(self, lane_tag: int) -> list[int] | None:
        lane = self.ctx.lanes.get(lane_tag)
        return None if lane is None else list(lane.committed)

    def snapshot(self) -> tuple:
        """Every bit of executor state a rejected plan must leave as it was (tests)."""
        c = self.ctx
        lanes = {
            tag: (
                l.seq, tuple(l.committed), l.pending_input, l.pending_logits, l.prefilled, l.prefill_end,
                l.rng_counter, l.finished, None if l.spec is None else (l.spec.depth, l.spec.misses, l.spec.resting),
            )
            for tag, l in c.lanes.items()
        }
        cache = tuple(
            (e.entry_id, e.seq, tuple(e.tokens), e.prompt, e.bytes, e.last_used, e.pins, e.exported is None, e.shared, e.leased)
            for e in c.pool.cache
        )
        leases = {h: (s.entry_id, tuple(s.prefix), s.expires_at_tick, s.adopted) for h, s in c.leases.live.items()}
        made = c.grammars.made
        grammars = None if made is None else dict(made.handles())
        return (
            lanes, frozenset(c.faulted), cache, leases, frozenset(c.leases.bare), frozenset(c.biases),
            dict(c.injected), c.last_plan_seq, c.tick_count, grammars,
            tuple(self.rings.rings[r].generation for r in sorted(self.rings.rings)),
        )
