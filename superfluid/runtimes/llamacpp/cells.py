"""Our own count of llama.cpp's KV cells (llama.cpp exposes no used-cells counter).

The mirror: a unified KV pool of ``total`` cells; a sequence's history is a list of
cell ids, one per token. A token ingested takes a fresh cell; ``llama_memory_seq_cp``
over a prefix adds the destination to those same cells (``copy_shares_cells``), so
the copy takes none; ``seq_rm`` drops the sequence from the cells past the cut. A
cell is used while any sequence holds it: exactly llama.cpp's rule for its cells.

Invariant: ``used == number of ids with refcount > 0`` and every list entry names a
live cell; the runtime mirrors a change only after llama.cpp made it.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np


class CellLedger:
    def __init__(self, total: int):
        self.total = total
        self.refs = np.zeros(total, dtype=np.int32)
        self._free = list(range(total - 1, -1, -1))
        self.cells: dict[int, np.ndarray] = {}  # seq -> cell ids, one per token

    @property
    def used(self) -> int:
        return self.total - len(self._free)

    @property
    def free(self) -> int:
        return len(self._free)

    def open(self, seq: int) -> None:
        self.cells[seq] = np.zeros(0, dtype=np.int32)

    def append(self, seq: int, n: int) -> None:
        """n fresh cells at the end of seq (llama.cpp found them, or we would not be here)."""
        if n > len(self._free):
            raise AssertionError(f"the ledger lost count: {n} cells taken, {len(self._free)} free")
        new = np.array([self._free.pop() for _ in range(n)], dtype=np.int32)
        self.refs[new] = 1
        self.cells[seq] = np.concatenate([self.cells[seq], new])

    def share(self, src: int, dst: int, n: int) -> None:
        ids = self.cells[src][:n]
        np.add.at(self.refs, ids, 1)
        self._drop(self.cells[dst])
        self.cells[dst] = ids.copy()

    def cut(self, seq: int, n: int) -> None:
        ids = self.cells[seq]
        self._drop(ids[n:])
        self.cells[seq] = ids[:n].copy()

    def close(self, seq: int) -> None:
        ids = self.cells.pop(seq, None)
        if ids is not None:
            self._drop(ids)

    def released(self, seqs: Iterable[int]) -> int:
        """Cells that dropping every one of these sequences would free."""
        held = [self.cells[s] for s in set(seqs) if s in self.cells]
        if not held:
            return 0
        ids, counts = np.unique(np.concatenate(held), return_counts=True)
        return int(np.count_nonzero(self.refs[ids] <= counts))

    def _drop(self, ids: np.ndarray) -> None:
        if not len(ids):
            return
        np.subtract.at(self.refs, ids, 1)
        gone = np.unique(ids[self.refs[ids] == 0])
        self._free.extend(int(i) for i in gone)
