"""The runtime primitives the executor drives (DESIGN §4).

A runtime owns sequences (``seq`` ids it hands out) and the memory behind them:
KV cells in a paged pool, or a recurrent state. The executor never looks inside;
it only calls these primitives and maps their errors to lane faults or a fatal exit.

Rows are float32 numpy vectors of length ``desc.vocab_size`` (logits before any
processing). A runtime may return views into one batched array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

from ..abi import LaneParams
from ..vocabulary import Vocabulary  # noqa: F401  (a leaf: the tokenizer builds it too)


# ------------------------------------------------------------------ errors


class PrimError(Exception):
    """Base of every error a primitive raises."""


class Fault(PrimError):
    """A per-lane failure with a fault code (abi.FaultCode or an injected one)."""

    def __init__(self, code: int, message: str = ""):
        super().__init__(message or f"fault {code}")
        self.code = code


class Capacity(PrimError):
    """Out of cells or sequence slots; the lane faults with OOM_TENTATIVE."""


class Fatal(PrimError):
    """The runtime can no longer be trusted; the worker exits 70."""


class Unsupported(PrimError):
    """The primitive cannot do this here (e.g. a partial truncate on a recurrent state)."""


class UnknownSeq(PrimError):
    pass


class OutOfBoundary(PrimError):
    pass


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class RuntimeDesc:
    runtime_id: str
    vocab_size: int
    max_batch: int  # feeds per step
    max_seq_len: int  # tokens a sequence may hold
    max_seqs: int = 0  # sequence slots; 0: unlimited
    page: int = 16  # cells per block; prefix-cache keys are whole pages
    prefill_step_tokens: int = 0  # tokens per prefill step; 0: no cap
    exact_only: bool = False  # recurrent state: no partial truncate, exact-prefix cache
    truncate_partial: bool = True  # seq_truncate works at any length
    copy_shares_cells: bool = False  # seq_copy costs no new cells (block refcounts)
    takeover_preferred: bool = False  # a lease may take a cache entry over instead of copying
    engine_sampling: bool = False  # step_sampled samples inside the runtime
    engine_draws: bool = False  # ... including temperature draws, not only greedy
    verify_batches: bool = True  # step_rows may carry several drafting lanes at once
    cell_bytes: int = 0  # bytes one cell (one token of one sequence) occupies
    # A row's logits are a function of its own token history alone: not of the step's other
    # feeds, its chunking, or whether its prefix came from the cache.
    batch_invariant: bool = False


@dataclass(frozen=True)
class Feed:
    seq: int
    tokens: Sequence[int]
    wants_row: bool  # step() returns the row after the last token


@dataclass(frozen=True)
class SampleSpec:
    temperature: float  # 0.0: greedy
    top_k: int
    top_p: float
    min_p: float
    rng_position: int  # rng_base + rng_counter: the draw is uniform(rng_position)

    def lane_params(self) -> LaneParams:
        """The filters as the host sampler (superfluid/sampling.py) takes them."""
        return LaneParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)


@dataclass(frozen=True)
class MemCounters:
    cells_total: int = 0  # 0: the runtime does not count cells
    cells_used: int = 0
    allocated_bytes: int = 0


# ------------------------------------------------------------- the protocol


@runtime_checkable
class RuntimePrimitives(Protocol):
    desc: RuntimeDesc

    def seq_create(self) -> int: ...

    def seq_copy(self, src: int, dst: int, n_tokens: int) -> None:
        """dst (empty) becomes the first n_tokens of src."""

    def seq_truncate(self, seq: int, n_tokens: int) -> None:
        """Keep the first n_tokens. Raises Unsupported where the state cannot be cut."""

    def seq_free(self, seq: int) -> None: ...

    def seq_len(self, seq: int) -> int: ...

    def seq_export(self, seq: int) -> object:
        """A payload holding the whole sequence outside the pool."""

    def seq_import(self, seq: int, payload: object) -> int:
        """Fill an empty seq from a payload; returns the tokens it now holds."""

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        """Ingest every feed's tokens; one row per feed with wants_row, in order."""

    def step_rows(self, feeds: Sequence[Feed]) -> list[list[np.ndarray]] | None:
        """Ingest, returning a row for every position of every feed; None: unsupported."""

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec]) -> list[int] | None:
        """Ingest and sample one token per feed inside the runtime; None: unsupported."""

    def mem_counters(self) -> MemCounters: ...

    def cells_released(self, seqs: Sequence[int]) -> int:
        """Cells that freeing these sequences would give back (shared blocks count once)."""

    def sync_steps(self, on: bool) -> None: ...

    def vocabulary(self) -> Vocabulary | None: ...

    def is_eos(self, token: int) -> bool: ...
