"""The paged KV pool: K/V storage over the blocks of a ``BlockAllocator``.

Storage: ``k``, ``v``: [n_layers, n_blocks * page, n_kv_heads, head_dim]; the cell of
token ``i`` of a sequence is ``table[i // page] * page + i % page`` (its *slot*).

Block tables, refcounts, copy on write and the capacity checks are the allocator's
(``runtimes/blocks.py``); this pool names sequences, moves the cells the allocator asks
to be copied, and turns tables into slots. A copy shares whole blocks and copies the
partial last one; a truncate into a shared block leaves it shared until the next write.
"""

from __future__ import annotations

import torch

from ..base import Fault, UnknownSeq
from ..blocks import BlockAllocator, BlockTable, CellCopy
from ...abi import FaultCode



class PagedKV:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, page: int,
                 dtype: torch.dtype, device: torch.device):
        self.page, self.n_blocks = page, n_blocks
        shape = (n_layers, n_blocks * page, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.blocks = BlockAllocator(n_blocks, page)
        self.seqs: dict[int, BlockTable] = {}
        self._next_id = 1

    # ------------------------------------------------------------ bookkeeping

    @property
    def cell_bytes(self) -> int:
        """Bytes of one token's K+V over all layers."""
        n_layers, _, h, d = self.k.shape
        return 2 * n_layers * h * d * self.k.element_size()

    @property
    def used_blocks(self) -> int:
        return self.blocks.used_blocks

    def table(self, seq: int) -> BlockTable:
        try:
            return self.seqs[seq]
        except KeyError:
            raise UnknownSeq(f"unknown seq {seq}") from None

    def _move(self, copies: list[CellCopy]) -> None:
        p = self.page
        for src, dst, cells in copies:
            self.k[:, dst * p: dst * p + cells] = self.k[:, src * p: src * p + cells]
            self.v[:, dst * p: dst * p + cells] = self.v[:, src * p: src * p + cells]

    # -------------------------------------------------------------- sequences

    def create(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self.seqs[seq] = BlockTable()
        return seq

    def free(self, seq: int) -> None:
        self.blocks.release(self.table(seq))
        del self.seqs[seq]

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """dst (empty) holds src's first n_tokens: whole blocks shared, the partial one copied."""
        s, d = self.table(src), self.table(dst)
        if d.length or d.blocks:
            raise Fault(FaultCode.INTERNAL, f"seq_copy: destination seq {dst} is not empty")
        if not 0 <= n_tokens <= s.length:
            raise Fault(FaultCode.INTERNAL, f"seq_copy: {n_tokens} tokens asked of seq {src} holding {s.length}")
        self._move(self.blocks.copy(s, d, n_tokens))

    def truncate(self, seq: int, n_tokens: int) -> None:
        t = self.table(seq)
        if not 0 <= n_tokens <= t.length:
            raise Fault(FaultCode.INTERNAL, f"seq_truncate: {n_tokens} > length {t.length} of seq {seq}")
        self.blocks.truncate(t, n_tokens)

    def released_cells(self, seqs) -> int:
        """Cells that freeing all of ``seqs`` gives back: blocks whose refcount drops to 0."""
        return self.blocks.cells_released([self.table(seq) for seq in seqs])

    # ---------------------------------------------------------------- writing

    def blocks_needed(self, seq: int, n_new: int) -> int:
        """New blocks that appending n_new tokens takes (including a copy on write)."""
        return self.blocks.blocks_needed(self.table(seq), n_new)

    def reserve(self, appends: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Make room for (seq, n_new) appends, all or nothing; returns each one's slots [n_new].
        Lengths are not advanced here: ``commit`` does that once the forward ran."""
        tables = [(self.table(seq), n) for seq, n in appends]
        self._move(self.blocks.reserve(tables))
        return [self.slots(t, t.length, t.length + n) for t, n in tables]

    def commit(self, seq: int, n_new: int) -> None:
        self.seqs[seq].length += n_new

    def slots(self, t: BlockTable, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 slots of positions [start, end)."""
        pos = torch.arange(start, end)
        table = torch.tensor(t.blocks, dtype=torch.int64)
        return table[pos // self.page] * self.page + pos % self.page

    # ------------------------------------------------------------ host copies

    def export(self, seq: int) -> dict:
        """The K/V of the sequence's tokens on the host: k, v [n_layers, n, n_kv_heads, head_dim]."""
        t = self.table(seq)
        idx = self.slots(t, 0, t.length).to(self.k.device)
        return {"n_tokens": t.length, "k": self.k[:, idx].cpu(), "v": self.v[:, idx].cpu()}

    def import_(self, seq: int, payload: dict) -> int:
        t = self.table(seq)
        if t.length or t.blocks:
            raise Fault(FaultCode.INTERNAL, f"seq_import: seq {seq} is not empty")
        try:
            n, k, v = int(payload["n_tokens"]), payload["k"], payload["v"]
            k, v = torch.as_tensor(k), torch.as_tensor(v)
        except (KeyError, TypeError, ValueError) as e:
            raise Fault(FaultCode.INTERNAL, f"seq_import: bad payload ({e})") from e
        want = (self.k.shape[0], n, *self.k.shape[2:])
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise Fault(FaultCode.INTERNAL, f"seq_import: payload shape {list(k.shape)}, expected {list(want)}")
        (slots,) = self.reserve([(seq, n)])
        slots = slots.to(self.k.device)
        self.k[:, slots] = k.to(self.k.device, self.k.dtype)
        self.v[:, slots] = v.to(self.v.device, self.v.dtype)
        t.length = n
        return n
