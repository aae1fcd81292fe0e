"""A small deterministic runtime that honours every primitive and flag.

The "model": a row is ``bigram[last token] + noise(hash of the whole history)``, a pure
function of the token history, so two paths to the same history give bit-identical
rows and any lost or duplicated token changes every later row.

Memory: in KV mode a sequence holds one cell per token in blocks of ``page`` cells
(``blocks.BlockAllocator``, as the torch pool); with ``copy_shares_cells`` a copy shares
whole blocks by reference count and copies the partial last one, and a truncate into a
shared block copies it at once. In ``exact_only`` (recurrent) mode a sequence is a fixed-size
state (hash, last token, length): it cannot be cut back to anything but 0, and cells
are not counted (``cells_total == 0``), only sequence slots.

``fail_on(primitive, error, times=1, after=0)`` makes a primitive raise, for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import numpy as np

from ..abi import LaneParams
from .. import sampling as hs
from .base import (
    Capacity,
    Feed,
    MemCounters,
    PrimError,
    RuntimeDesc,
    SampleSpec,
    Unsupported,
    UnknownSeq,
    Vocabulary,
)
from .blocks import BlockAllocator, BlockTable
from .toy_vocab import EOS, ToyTokenizer, toy_vocabulary

_HASH0 = 0x243F6A8885A308D3


def _mix(h: int, token: int) -> int:
    return hs.splitmix64(h ^ (token * 0x9E3779B97F4A7C15 & ((1 << 64) - 1)))


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # KV mode: the history
    hashes: list[int] = field(default_factory=lambda: [_HASH0])  # hashes[i]: hash of tokens[:i]
    table: BlockTable = field(default_factory=BlockTable)  # KV mode: table.length == len(tokens)
    # exact_only mode keeps only the state
    state: tuple[int, int, int] = (_HASH0, -1, 0)  # (hash, last token, length)


@dataclass
class _Failure:
    error: PrimError
    times: int
    after: int


class ToyRuntime:
    def __init__(
        self,
        vocab_size: int = 160,
        n_cells: int = 4096,
        page: int = 4,
        max_seqs: int = 0,
        max_batch: int = 16,
        max_seq_len: int = 512,
        exact_only: bool = False,
        copy_shares_cells: bool = False,
        takeover_preferred: bool = False,
        engine_sampling: bool = False,
        prefill_step_tokens: int = 0,
        verify_batches: bool = True,
        seed: int = 1234,
        step_delay: float = 0.0,
    ):
        self.desc = RuntimeDesc(
            runtime_id="toy",
            vocab_size=vocab_size,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            max_seqs=max_seqs,
            page=page,
            prefill_step_tokens=prefill_step_tokens,
            exact_only=exact_only,
            truncate_partial=not exact_only,
            copy_shares_cells=copy_shares_cells and not exact_only,
            takeover_preferred=takeover_preferred,
            engine_sampling=engine_sampling,
            engine_draws=engine_sampling,
            verify_batches=verify_batches,
            cell_bytes=64,
            batch_invariant=True,  # rows are a function of the history alone
        )
        rng = np.random.default_rng(seed)
        self.bigram = (3.0 * rng.standard_normal((vocab_size, vocab_size))).astype(np.float32)
        self.bigram[:, EOS] -= 4.0  # EOS is rare but reachable
        self.bigram[:, 130:] = -30.0  # ids past the pieces are never likely
        self.blocks = BlockAllocator(0 if exact_only else n_cells // page, page)
        self.seqs: dict[int, _Seq] = {}
        self.next_seq = 1
        self.failures: dict[str, _Failure] = {}
        self.step_delay = step_delay  # seconds each step sleeps (latency tests)
        self.steps = 0
        self.synced = False
        self._vocab = toy_vocabulary(vocab_size)
        self.tokenizer = ToyTokenizer(vocab_size)

    # ------------------------------------------------------------ test hooks
    def fail_on(self, primitive: str, error: PrimError, times: int = 1, after: int = 0) -> None:
        self.failures[primitive] = _Failure(error, times, after)

    def _maybe_fail(self, primitive: str) -> None:
        f = self.failures.get(primitive)
        if f is None:
            return
        if f.after > 0:
            f.after -= 1
            return
        f.times -= 1
        if f.times <= 0:
            del self.failures[primitive]
        raise f.error

    def snapshot(self) -> tuple:
        """Everything a rejected plan must leave untouched."""
        seqs = {
            k: (tuple(s.tokens), tuple(s.table.blocks), s.table.length, s.state) for k, s in self.seqs.items()
        }
        return (seqs, self.blocks.snapshot(), self.next_seq)

    # ------------------------------------------------------------ the model
    def row_for(self, h: int, last: int) -> np.ndarray:
        noise = np.random.default_rng(h).standard_normal(self.desc.vocab_size).astype(np.float32)
        base = self.bigram[last] if last >= 0 else self.bigram[EOS]
        return base + noise

    # ------------------------------------------------------------ memory
    def _get(self, seq: int) -> _Seq:
        s = self.seqs.get(seq)
        if s is None:
            raise UnknownSeq(f"seq {seq}")
        return s

    def _len(self, s: _Seq) -> int:
        return s.state[2] if self.desc.exact_only else len(s.tokens)

    def _grow_cost(self, s: _Seq, n: int) -> int:
        """Blocks that appending n tokens to s takes (a shared partial last block is copied)."""
        return 0 if self.desc.exact_only else self.blocks.blocks_needed(s.table, n)

    def _append(self, s: _Seq, tokens: Sequence[int]) -> None:
        if self.desc.exact_only:
            h, last, n = s.state
            for t in tokens:
                h = _mix(h, t)
                last, n = t, n + 1
            s.state = (h, last, n)
            return
        self.blocks.reserve([(s.table, len(tokens))])  # no cells to move: the toy stores none
        for t in tokens:
            s.hashes.append(_mix(s.hashes[-1], t))
            s.tokens.append(t)
        s.table.length = len(s.tokens)

    def _head(self, s: _Seq) -> tuple[int, int]:
        if self.desc.exact_only:
            return s.state[0], s.state[1]
        return s.hashes[-1], (s.tokens[-1] if s.tokens else -1)

    # ------------------------------------------------------------ primitives
    def seq_create(self) -> int:
        self._maybe_fail("seq_create")
        if self.desc.max_seqs and len(self.seqs) >= self.desc.max_seqs:
            raise Capacity("no sequence slot")
        seq = self.next_seq
        self.next_seq += 1
        self.seqs[seq] = _Seq()
        return seq

    def seq_copy(self, src: int, dst: int, n_tokens: int) -> None:
        self._maybe_fail("seq_copy")
        a, b = self._get(src), self._get(dst)
        if self._len(b) != 0 or n_tokens > self._len(a):
            raise Unsupported("copy into a non-empty sequence or past the source")
        if self.desc.exact_only:
            if n_tokens not in (0, a.state[2]):
                raise Unsupported("a recurrent state is copied whole")
            b.state = a.state if n_tokens else b.state
            return
        self.blocks.copy(a.table, b.table, n_tokens, share=self.desc.copy_shares_cells)
        b.tokens = a.tokens[:n_tokens]
        b.hashes = a.hashes[: n_tokens + 1]

    def seq_truncate(self, seq: int, n_tokens: int) -> None:
        self._maybe_fail("seq_truncate")
        s = self._get(seq)
        n = self._len(s)
        if n_tokens > n:
            raise Unsupported("truncate past the end")
        if self.desc.exact_only:
            if n_tokens not in (0, n):
                raise Unsupported("a recurrent state cannot be cut back")
            if n_tokens == 0:
                s.state = _Seq().state
            return
        self.blocks.truncate(s.table, n_tokens, unshare=True)
        del s.tokens[n_tokens:]
        del s.hashes[n_tokens + 1 :]

    def seq_free(self, seq: int) -> None:
        s = self.seqs.pop(seq, None)
        if s is not None:
            self.blocks.release(s.table)

    def seq_len(self, seq: int) -> int:
        return self._len(self._get(seq))

    def seq_export(self, seq: int) -> object:
        self._maybe_fail("seq_export")
        s = self._get(seq)
        if self.desc.exact_only:
            return ("state", s.state)
        return ("kv", list(s.tokens))

    def seq_import(self, seq: int, payload: object) -> int:
        self._maybe_fail("seq_import")
        s = self._get(seq)
        if self._len(s) != 0:
            raise Unsupported("import into a non-empty sequence")
        kind, data = payload
        if kind == "state":
            s.state = data
            return data[2]
        self._append(s, data)  # all or nothing: reserve checks the blocks first
        return len(data)

    def _check_room(self, feeds: Sequence[Feed]) -> None:
        need = sum(self._grow_cost(self._get(f.seq), len(f.tokens)) for f in feeds)
        if need > len(self.blocks.free):
            raise Capacity(f"{need} blocks wanted, {len(self.blocks.free)} free")
        for f in feeds:
            if self._len(self._get(f.seq)) + len(f.tokens) > self.desc.max_seq_len:
                raise Capacity("past max_seq_len")
            if any(not 0 <= t < self.desc.vocab_size for t in f.tokens):
                raise Unsupported("token outside the vocabulary")

    def _ingest(self, feeds: Sequence[Feed], every: bool) -> list[list[np.ndarray]]:
        if self.step_delay:
            time.sleep(self.step_delay)
        self._check_room(feeds)
        self.steps += 1
        out = []
        for f in feeds:
            s = self._get(f.seq)
            rows = []
            for i, t in enumerate(f.tokens):
                self._append(s, [t])
                if every or (f.wants_row and i == len(f.tokens) - 1):
                    rows.append(self.row_for(*self._head(s)))
            out.append(rows)
        return out

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        self._maybe_fail("step")
        rows = self._ingest(feeds, every=False)
        return [r[-1] for r, f in zip(rows, feeds) if f.wants_row]

    def step_rows(self, feeds: Sequence[Feed]) -> list[list[np.ndarray]] | None:
        self._maybe_fail("step_rows")
        return self._ingest(feeds, every=True)

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec]) -> list[int] | None:
        if not self.desc.engine_sampling:
            return None
        self._maybe_fail("step_sampled")
        rows = self._ingest(feeds, every=False)
        out = []
        for r, spec in zip(rows, specs):
            row = r[-1]
            if spec.temperature <= 0.0:
                out.append(hs.argmax(row))
            else:
                params = LaneParams(temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p)
                out.append(hs.sample(row, params, hs.uniform(spec.rng_position)))
        return out

    def mem_counters(self) -> MemCounters:
        used = self.blocks.cells_used
        return MemCounters(cells_total=self.blocks.cells_total, cells_used=used,
                           allocated_bytes=used * self.desc.cell_bytes)

    def cells_released(self, seqs: Sequence[int]) -> int:
        """Unknown seqs release nothing (freeing one is a no-op too)."""
        return self.blocks.cells_released(self.seqs[seq].table for seq in seqs if seq in self.seqs)

    def cells_of_live_seqs(self) -> int:
        """Cells the live sequences hold, shared blocks counted once (invariant checks)."""
        return self.blocks.cells_held(s.table for s in self.seqs.values())

    def sync_steps(self, on: bool) -> None:
        self.synced = on

    def vocabulary(self) -> Vocabulary | None:
        return self._vocab

    def is_eos(self, token: int) -> bool:
        return token == EOS

    def with_desc(self, **changes) -> "ToyRuntime":
        self.desc = replace(self.desc, **changes)
        return self
