"""The paged KV pool: blocks of ``page`` cells, per-sequence block tables, refcounts.

Storage: ``k``, ``v``: [n_layers, n_blocks * page, n_kv_heads, head_dim]; the cell of
token ``i`` of a sequence is ``table[i // page] * page + i % page`` (its *slot*).

Invariants:
- A block's refcount is the number of sequence tables that list it; a block with
  refcount 0 is on the free list and no table lists it.
- A sequence never writes a block whose refcount is > 1: ``reserve`` copies such a block
  first (copy on write). Copies share whole blocks and copy the partial last one, so only
  a truncate into a shared block ever needs that.
- Every mutating call checks capacity before it changes anything (``Capacity``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..base import Capacity, Fault, UnknownSeq
from ...abi import FaultCode


@dataclass
class SeqTable:
    blocks: list[int] = field(default_factory=list)
    length: int = 0  # tokens held; cells [0, length) are valid


class PagedKV:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_blocks: int, page: int,
                 dtype: torch.dtype, device: torch.device):
        self.page, self.n_blocks = page, n_blocks
        shape = (n_layers, n_blocks * page, n_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.refs = [0] * n_blocks
        self.free_blocks = list(range(n_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.seqs: dict[int, SeqTable] = {}
        self._next_id = 1

    # ------------------------------------------------------------ bookkeeping

    @property
    def cell_bytes(self) -> int:
        """Bytes of one token's K+V over all layers."""
        n_layers, _, h, d = self.k.shape
        return 2 * n_layers * h * d * self.k.element_size()

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self.free_blocks)

    def table(self, seq: int) -> SeqTable:
        try:
            return self.seqs[seq]
        except KeyError:
            raise UnknownSeq(f"unknown seq {seq}") from None

    def _alloc(self) -> int:
        b = self.free_blocks.pop()
        self.refs[b] = 1
        return b

    def _decref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_blocks.append(b)

    def _copy_block(self, src: int, dst: int, cells: int) -> None:
        p = self.page
        self.k[:, dst * p: dst * p + cells] = self.k[:, src * p: src * p + cells]
        self.v[:, dst * p: dst * p + cells] = self.v[:, src * p: src * p + cells]

    # -------------------------------------------------------------- sequences

    def create(self) -> int:
        seq = self._next_id
        self._next_id += 1
        self.seqs[seq] = SeqTable()
        return seq

    def free(self, seq: int) -> None:
        t = self.table(seq)
        for b in t.blocks:
            self._decref(b)
        del self.seqs[seq]

    def copy(self, src: int, dst: int, n_tokens: int) -> None:
        """dst (empty) holds src's first n_tokens: whole blocks shared, the partial one copied."""
        s, d = self.table(src), self.table(dst)
        if d.length or d.blocks:
            raise Fault(FaultCode.INTERNAL, f"seq_copy: destination seq {dst} is not empty")
        if not 0 <= n_tokens <= s.length:
            raise Fault(FaultCode.INTERNAL, f"seq_copy: {n_tokens} tokens asked of seq {src} holding {s.length}")
        full, part = divmod(n_tokens, self.page)
        if part and not self.free_blocks:
            raise Capacity("seq_copy: no free block for the partial last block")
        for b in s.blocks[:full]:
            self.refs[b] += 1
        d.blocks = s.blocks[:full]
        if part:
            b = self._alloc()
            self._copy_block(s.blocks[full], b, part)
            d.blocks.append(b)
        d.length = n_tokens

    def truncate(self, seq: int, n_tokens: int) -> None:
        t = self.table(seq)
        if not 0 <= n_tokens <= t.length:
            raise Fault(FaultCode.INTERNAL, f"seq_truncate: {n_tokens} > length {t.length} of seq {seq}")
        keep = -(-n_tokens // self.page)
        for b in t.blocks[keep:]:
            self._decref(b)
        del t.blocks[keep:]
        t.length = n_tokens

    def released_cells(self, seqs) -> int:
        """Cells that freeing all of ``seqs`` gives back: blocks whose refcount drops to 0."""
        counts: dict[int, int] = {}
        for seq in set(seqs):
            for b in self.table(seq).blocks:
                counts[b] = counts.get(b, 0) + 1
        return sum(self.page for b, c in counts.items() if self.refs[b] == c)

    # ---------------------------------------------------------------- writing

    def blocks_needed(self, seq: int, n_new: int) -> int:
        """New blocks that appending n_new tokens takes (including a copy on write)."""
        t = self.table(seq)
        have = len(t.blocks)
        need = -(-(t.length + n_new) // self.page) - have
        if n_new and t.length % self.page and self.refs[t.blocks[-1]] > 1:
            need += 1  # the partial last block is shared: it gets copied first
        return need

    def reserve(self, appends: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Make room for (seq, n_new) appends, all or nothing; returns each one's slots [n_new].
        Lengths are not advanced here: ``commit`` does that once the forward ran."""
        need = sum(self.blocks_needed(seq, n) for seq, n in appends)
        if need > len(self.free_blocks):
            raise Capacity(f"KV pool: {need} blocks needed, {len(self.free_blocks)} free")
        out = []
        for seq, n in appends:
            t = self.table(seq)
            if n and t.length % self.page and self.refs[t.blocks[-1]] > 1:
                b = self._alloc()
                self._copy_block(t.blocks[-1], b, t.length % self.page)
                self._decref(t.blocks[-1])
                t.blocks[-1] = b
            while len(t.blocks) * self.page < t.length + n:
                t.blocks.append(self._alloc())
            out.append(self.slots(t, t.length, t.length + n))
        return out

    def commit(self, seq: int, n_new: int) -> None:
        self.seqs[seq].length += n_new

    def slots(self, t: SeqTable, start: int, end: int) -> torch.Tensor:
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
