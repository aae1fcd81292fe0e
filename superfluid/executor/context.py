"""What a tick's phases work on, named: the runtime, the lanes, the cache pool, the
leases, the handles, speculation and pacing. The phases never see the Executor.

Invariants:
- ``lanes`` holds live lanes; a lane that faulted leaves it at once and its tag waits
  in ``faulted`` for the scheduler's retire.
- ``tick_count`` counts accepted plans; cache ``last_used`` and lease expiry read it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..abi import OpCompletion, Status
from ..rings import Rings
from ..runtimes.base import RuntimeDesc, RuntimePrimitives
from .lane import Lane
from .leases import Leases
from .pool import CachePool, ExecutorConfig
from .speculate import SpecConfig, SpecGate
from .token_rules import TokenRules

if TYPE_CHECKING:
    from .grammar import GrammarStore


@dataclass
class Speculation:
    config: SpecConfig | None = None  # the loaded strategy; None: nobody drafts
    slot: int = 0  # lanes opt in by naming it
    gate: SpecGate = field(default_factory=SpecGate)


@dataclass
class Pace:
    """What the executor learns as it runs."""

    prefill_secs_per_token: float | None = None  # a moving average; sizes latency steps
    penalty_exempt: frozenset[int] | None = None  # specials and EOS, once a lane penalizes


class Grammars:
    """The grammar store, made on first use: xgrammar is slow to import, and a runtime
    without a vocabulary has none."""

    def __init__(self, prim: RuntimePrimitives):
        self._prim = prim
        self._store: GrammarStore | None = None
        self._making = threading.Lock()  # one store, whichever thread makes it first

    @property
    def store(self) -> "GrammarStore | None":
        with self._making:
            if self._store is None:
                vocab = self._prim.vocabulary()
                if vocab is None:
                    return None
                from .grammar import GrammarStore  # deferred for import time, not a cycle

                self._store = GrammarStore(vocab, self._prim.desc.vocab_size)
            return self._store

    def warm(self) -> None:
        """Make the store in a background thread (a worker does at start), so that the
        first grammar a request brings does not pay xgrammar's import and vocabulary
        setup (seconds) on the tick loop."""
        threading.Thread(target=lambda: self.store, name="grammar-warm", daemon=True).start()

    @property
    def made(self) -> "GrammarStore | None":
        """The store if it exists; never makes one."""
        return self._store

    def release(self, handle: int) -> None:
        if self._store is not None:
            self._store.release(handle)


class TickContext:
    def __init__(self, prim: RuntimePrimitives, rings: Rings, config: ExecutorConfig,
                 fatal: Callable[[str], Status]):
        self.prim = prim
        self.desc: RuntimeDesc = prim.desc
        self.rings = rings
        self.fatal = fatal  # the one fatal path: exits 70 in a worker, else returns FATAL
        self.lanes: dict[int, Lane] = {}
        self.faulted: set[int] = set()  # lanes that faulted and await their retire
        self.injected: dict[int, int] = {}  # lane -> fault code at its next decode (tests)
        self.pool = CachePool(prim, config)
        self.handles = itertools.count(1)
        self.leases = Leases(prim, self.pool.cache, self.handles)
        self.biases: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.rules: dict[int, TokenRules] = {}  # token rules, in the same handle space
        self.grammars = Grammars(prim)
        self.spec = Speculation()
        self.pace = Pace()
        self.done_ops: list[OpCompletion] = []  # reported in the next tick's events
        self.tick_count = 0
        self.last_plan_seq: int | None = None

    def live_sequences(self) -> int:
        return len(self.lanes) + len(self.pool.cache.resident()) + len(self.leases.bare)
