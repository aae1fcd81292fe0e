"""What the engine may ask of an executor, wherever the executor runs (DESIGN §3, §7).

``ExecutorInterface`` is the tick and the operations between ticks. ``Executor`` (in
this process) and ``WorkerClient`` (over a socket to a worker process) both implement
it, and the worker's wire is made from these signatures (worker/ops.py), so the list
of operations is written here once.

``Supervised`` is what the engine needs of whatever keeps the executor alive: the
worker's supervisor, or ``InProcess`` when there is no other process to watch. An
executor that is lost raises ``ExecutorLost``; the engine then calls ``restart`` and
replays its requests.

This module is a leaf: it imports only records and configurations.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, runtime_checkable

from ..abi import FaultCode, Lease, PartialEmitCallback, TickOutcome, TickPlan
from ..runtimes.base import RuntimeDesc
from .speculate import SpecConfig


class ExecutorLost(Exception):
    """The executor's process is gone (died, exited, stopped beating or progressing).
    ``Supervised.restart`` gives a clean one; every handle of the old one is gone."""


@runtime_checkable
class ExecutorInterface(Protocol):
    desc: RuntimeDesc

    def run_tick(self, plan: TickPlan, on_partial_emit: PartialEmitCallback | None = None) -> TickOutcome:
        """Validate the whole plan, then carry it out (DESIGN §3)."""

    def lease_prefix(self, prompt: list[int], ttl_ticks: int = 4, determinism_class: int = 0,
                   cache_key: int = 0) -> Lease | None:
        """Pin the cached entry sharing the longest prefix with the prompt until
        tick_count + ttl_ticks; None when nothing is cached."""

    def release_lease(self, handle: int) -> None:
        """Unpin a lease's entry (a lease not held is ignored)."""

    def adopt(self, tokens: list[int], payload: Any, ttl_ticks: int = 4, determinism_class: int = 0) -> Lease:
        """Import an exported sequence as a bare one, leased to the admit whose
        prompt starts with ``tokens``."""

    def register_logit_bias(self, bias: dict[int, float]) -> int:
        """A handle for a token -> bias map; ValueError for a token outside the vocabulary."""

    def release_logit_bias(self, handle: int) -> None: ...

    def register_token_rules(self, allowed: list[int] | None, bad_words: list[list[int]], min_tokens: int,
                             min_ban: list[int]) -> int:
        """A handle for a request's token rules (executor/token_rules.py): only ``allowed``
        may be picked (None: any); each bad word's last token is banned after the rest;
        ``min_ban`` (and the runtime's EOS) are banned until ``min_tokens`` were generated.
        ValueError for a token outside the vocabulary."""

    def release_token_rules(self, handle: int) -> None: ...

    def compile_grammar(self, kind: str, source: str | None = None, wait: bool = True) -> int:
        """A grammar handle; GrammarError (a ValueError) for an invalid grammar. With
        ``wait`` false the compile runs in the background (a bounded pool, a time
        budget): the handle is usable once ``grammar_states`` says READY."""

    def grammar_states(self, handles: list[int]) -> list[tuple[int, str]]:
        """Per grammar handle: (0 pending | 1 ready | 2 failed, the failure's message)."""

    def release_grammar(self, handle: int) -> None: ...

    def load_strategy(self, cfg: SpecConfig = SpecConfig()) -> int:
        """Load a speculative strategy; returns the slot lanes opt in with."""

    def inject_fault(self, lane_tag: int, code: int = FaultCode.INJECTED) -> None:
        """The lane faults with this code at its next decode (tests)."""

    def export_entries(self, entry_ids: list[int] | None = None) -> list[int]:
        """Move unpinned resident cache entries to host memory; returns those moved."""

    def import_entries(self, entry_ids: list[int] | None = None) -> list[int]:
        """Bring exported cache entries back into the pool; returns those brought."""

    def export_prefix(self, tokens: list[int]) -> tuple[list[int], Any] | None:
        """(tokens, payload) of the longest cached prefix of ``tokens``, for another
        executor's ``adopt``; None when nothing fits."""


@runtime_checkable
class Supervised(Protocol):
    @property
    def pid(self) -> int | None:
        """The process that runs the model; None while none does (between a lost
        worker and its replacement)."""

    def health(self) -> dict | None:
        """``{"state", "restarts", "last_exit"}`` of a supervised process, None when
        there is none. Safe from any thread."""

    def check(self) -> None:
        """Raise ``ExecutorLost`` if the process died while nothing ran."""

    def restart(self) -> None:
        """A clean executor after ``ExecutorLost``."""

    def close(self) -> None:
        """Stop the process and give back what it shared."""


class InProcess:
    """``Supervised`` for an executor in this process: nothing to watch or restart."""

    @property
    def pid(self) -> int:
        return os.getpid()

    def health(self) -> None:
        return None

    def check(self) -> None:
        pass  # this process is alive: it is the one asking

    def restart(self) -> None:
        raise RuntimeError("an in-process executor is never lost, so it is never restarted")

    def close(self) -> None:
        pass
