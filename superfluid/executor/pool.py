"""The prefix cache over the runtime's pool: what an entry costs, where it goes when it
leaves the pool, and how much of the pool the cache may keep.

Invariants:
- An entry that leaves the pool is exported where host memory has room, else dropped;
  either way its cells go back, and the caller reports it as a shed entry.
- Host memory holds exported entries least-recently-used, 24h entries last, within
  ``host_cache_bytes`` and ``host_cache_entries``.
- Keyed entries within the last accepted plan's protected quota are never picked.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..abi import CacheClassBytes, OpCompletion, OpKind
from ..runtimes.base import Fatal, PrimError, RuntimePrimitives
from .cache import CacheEntry, PrefixCache, Retention


@dataclass(frozen=True)
class ExecutorConfig:
    cache_max_fraction: float = 0.9  # resident cache bytes kept under this share of the pool
    host_cache_bytes: int = 64 << 20  # entries leaving the pool are exported while this holds them
    host_cache_entries: int = 256  # ... and while there are fewer exported entries than this
    fatal_exit: bool | None = None  # None: from SUPERFLUID_FATAL_EXIT


class CachePool:
    def __init__(self, prim: RuntimePrimitives, config: ExecutorConfig):
        self.prim = prim
        self.desc = prim.desc
        self.config = config
        self.cache = PrefixCache()
        self.protected_quota = 0  # the last accepted plan's protected_quota_bytes (keyed entries)

    @property
    def page(self) -> int:
        return max(self.desc.page, 1)

    def entry_bytes(self, n_tokens: int) -> int:
        if self.desc.exact_only:
            return self.desc.cell_bytes  # a recurrent state's size does not grow
        return n_tokens * self.desc.cell_bytes

    def pool_bytes(self) -> int:
        return self.prim.mem_counters().cells_total * self.desc.cell_bytes

    def host_room(self, nbytes: int) -> bool:
        # An entry leaving the pool counts only against the 24h entries there: settle()
        # then drops the oldest others until the budget holds.
        return self.cache.exported_bytes(Retention.EXTENDED) + nbytes <= self.config.host_cache_bytes

    def protected(self) -> frozenset[int]:
        return self.cache.protected(self.protected_quota)

    def leave(self, e: CacheEntry, evicted: list[tuple[int, int]]) -> None:
        """The entry leaves the pool; (bytes, tokens) joins ``evicted``. A Fatal export
        propagates: the tick takes the fatal path."""
        evicted.append((e.bytes, len(e.tokens)))
        seq = e.seq
        assert seq is not None
        payload = None
        if self.host_room(e.bytes):
            try:
                payload = self.prim.seq_export(seq)
            except PrimError as err:
                if isinstance(err, Fatal):
                    raise
                payload = None  # dropped instead of exported
        self.prim.seq_free(seq)
        if payload is None:
            self.cache.remove(e.entry_id)
        else:
            e.seq, e.exported = None, payload

    def settle(self, evicted: list[tuple[int, int]]) -> None:
        """Keep the resident cache under its share of the pool, LRU first; exported
        entries past the host budget go for good (24h last, then LRU first)."""
        cap = int(self.pool_bytes() * self.config.cache_max_fraction)
        if cap <= 0:
            return
        for e in self.cache.eviction_order(self.protected()):
            if self.cache.resident_bytes() <= cap:
                break
            self.leave(e, evicted)
        olds = sorted((e for e in self.cache if e.seq is None and e.pins == 0),
                      key=lambda e: (e.retention == Retention.EXTENDED, e.last_used, e.entry_id))
        exported = [e for e in self.cache if e.seq is None]
        nbytes, count = sum(e.bytes for e in exported), len(exported)
        for e in olds:
            if nbytes <= self.config.host_cache_bytes and count <= self.config.host_cache_entries:
                break
            self.cache.remove(e.entry_id)
            nbytes, count = nbytes - e.bytes, count - 1

    def export_entries(self, entry_ids: list[int] | None, done_ops: list[OpCompletion]) -> list[int]:
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
                done_ops.append(OpCompletion(OpKind.EXPORT, e.entry_id, 1))
                continue
            self.prim.seq_free(e.seq)
            e.seq, e.exported = None, payload
            done.append(e.entry_id)
            done_ops.append(OpCompletion(OpKind.EXPORT, e.entry_id, 0, e.bytes))
        return done

    def import_entries(self, entry_ids: list[int] | None, done_ops: list[OpCompletion]) -> list[int]:
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
                n = -1
            if n != len(e.tokens):
                self.prim.seq_free(seq)
                done_ops.append(OpCompletion(OpKind.IMPORT, e.entry_id, 1))
                continue
            e.seq, e.exported = seq, None
            done.append(e.entry_id)
            done_ops.append(OpCompletion(OpKind.IMPORT, e.entry_id, 0, e.bytes))
        return done

    def export_prefix(self, tokens: list[int]) -> tuple[list[int], object] | None:
        """A copy of the state of the longest cached prefix of ``tokens`` that is a whole
        entry, as (its tokens, a runtime payload); the entry stays. None when nothing is
        cached or the export fails."""
        found = self.cache.longest_prefix(list(tokens), self.page, self.desc.exact_only)
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

    def classes(self) -> list[CacheClassBytes]:
        """Per retention class: resident, protected and exported bytes (metrics)."""
        protected = self.protected()
        out = []
        for r in (Retention.NONE, Retention.IN_MEMORY, Retention.EXTENDED):
            es = [e for e in self.cache if e.retention == r]
            out.append(CacheClassBytes(
                r, sum(e.bytes for e in es if e.seq is not None),
                sum(e.bytes for e in es if e.entry_id in protected), sum(e.bytes for e in es if e.seq is None)))
        return out
