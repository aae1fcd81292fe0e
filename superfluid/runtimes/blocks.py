"""The block allocator of a paged pool: ``page`` cells make a block; sequences hold block
tables; a copy may share whole blocks by reference count.

Only the arithmetic of blocks lives here, no storage: where a block's cells must be copied
(a copy's unshared blocks, a copy on write) the operation returns ``CellCopy`` moves for
the runtime to carry out on its own storage (the torch pool copies K/V; the toy has none).

Invariants:
- A block's refcount is the number of tables that list it; a block with refcount 0 is on
  the free list and no table lists it.
- A table covers its tokens: ``len(blocks) >= ceil(length / page)``; blocks past that are
  reserved for tokens not yet committed.
- A sequence never writes a block whose refcount is > 1: ``reserve`` (or ``truncate`` with
  ``unshare``) copies such a partial last block first (copy on write).
- Every operation that takes blocks checks that they are free before it changes anything
  (``Capacity``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

from .base import Capacity


@dataclass
class BlockTable:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens held; cells [0, length) are valid


class CellCopy(NamedTuple):
    """Cells [0, cells) of block ``src`` go to block ``dst``."""
    src: int
    dst: int
    cells: int


class BlockAllocator:
    def __init__(self, n_blocks: int, page: int):
        self.n_blocks, self.page = n_blocks, page
        self.refs = [0] * n_blocks
        self.free = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first

    # ---------------------------------------------------------------- counters

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self.free)

    @property
    def cells_total(self) -> int:
        return self.n_blocks * self.page

    @property
    def cells_used(self) -> int:
        return self.used_blocks * self.page

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page)

    def cells_released(self, tables: Iterable[BlockTable]) -> int:
        """Cells that releasing all of ``tables`` (each once) gives back: blocks whose refcount drops to 0."""
        counts: dict[int, int] = {}
        for t in {id(t): t for t in tables}.values():
            for b in t.blocks:
                counts[b] = counts.get(b, 0) + 1
        return sum(self.page for b, c in counts.items() if self.refs[b] == c)

    def cells_held(self, tables: Iterable[BlockTable]) -> int:
        """Cells the tables hold, shared blocks counted once."""
        return len({b for t in tables for b in t.blocks}) * self.page

    def snapshot(self) -> tuple:
        return tuple(self.refs), tuple(self.free)

    # ------------------------------------------------------------- refcounts

    def _alloc(self) -> int:
        b = self.free.pop()
        self.refs[b] = 1
        return b

    def _decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free.append(b)

    def _shared_tail(self, t: BlockTable) -> bool:
        """The partial last block is listed by another table too: writing it needs a copy."""
        return bool(t.length % self.page) and self.refs[t.blocks[-1]] > 1

    def _unshare_tail(self, t: BlockTable) -> CellCopy:
        new = self._alloc()
        old = t.blocks[-1]
        self._decref(old)
        t.blocks[-1] = new
        return CellCopy(old, new, t.length % self.page)

    # ----------------------------------------------------------------- tables

    def release(self, t: BlockTable) -> None:
        """Give back every block of ``t``, which is left empty."""
        for b in t.blocks:
            self._decref(b)
        t.blocks, t.length = [], 0

    def copy(self, src: BlockTable, dst: BlockTable, n_tokens: int, *, share: bool = True) -> list[CellCopy]:
        """``dst`` (empty) holds src's first n_tokens: whole blocks shared when ``share``, the
        rest in new blocks, whose cells the returned moves fill."""
        full = n_tokens // self.page if share else 0
        need = self.blocks_for(n_tokens) - full
        if need > len(self.free):
            raise Capacity(f"copy: {need} blocks needed, {len(self.free)} free")
        for b in src.blocks[:full]:
            self.refs[b] += 1
        dst.blocks = src.blocks[:full]
        moves = []
        for i in range(full, full + need):
            dst.blocks.append(self._alloc())
            moves.append(CellCopy(src.blocks[i], dst.blocks[-1], min(self.page, n_tokens - i * self.page)))
        dst.length = n_tokens
        return moves

    def truncate(self, t: BlockTable, n_tokens: int, *, unshare: bool = False) -> list[CellCopy]:
        """Cut ``t`` to n_tokens (<= its length): blocks past the last one they use go back.
        ``unshare``: copy a shared partial last block now rather than at the next write."""
        keep = self.blocks_for(n_tokens)
        cow = unshare and n_tokens % self.page != 0 and keep > 0 and self.refs[t.blocks[keep - 1]] > 1
        if cow and not self.free:
            raise Capacity("truncate: no free block to copy a shared block")
        for b in t.blocks[keep:]:
            self._decref(b)
        del t.blocks[keep:]
        t.length = n_tokens
        return [self._unshare_tail(t)] if cow else []

    def blocks_needed(self, t: BlockTable, n_new: int) -> int:
        """New blocks that appending n_new tokens to ``t`` takes (a copy on write included)."""
        need = self.blocks_for(t.length + n_new) - len(t.blocks)
        if n_new and self._shared_tail(t):
            need += 1
        return need

    def reserve(self, appends: list[tuple[BlockTable, int]]) -> list[CellCopy]:
        """Blocks for (table, n_new) appends, all or nothing; returns the copies on write.
        Lengths are not advanced: the caller does that once the tokens are written."""
        need = sum(self.blocks_needed(t, n) for t, n in appends)
        if need > len(self.free):
            raise Capacity(f"{need} blocks needed, {len(self.free)} free")
        moves = []
        for t, n in appends:
            if n and self._shared_tail(t):
                moves.append(self._unshare_tail(t))
            while len(t.blocks) < self.blocks_for(t.length + n):
                t.blocks.append(self._alloc())
        return moves
