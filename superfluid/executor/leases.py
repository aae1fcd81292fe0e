"""Leases: handles that pin a cached prefix (or hold an adopted sequence) for one admit.

(The reference ABI, superfluid-executor 0.1.4, calls a lease a "seed": ``seed_handle``,
``RejectStaleSeed``; ours says lease everywhere: ``lease_handle``, ``REJECT_STALE_LEASE``.)
Invariants:
- A lease on a cache entry holds one of its ``pins`` until the lease is consumed by an
  admit, released, or expires (``expires_at_tick`` < tick count).
- An adopted lease owns a bare sequence (outside any lane and the cache) until its
  admit takes it; a lease that goes unconsumed frees it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..abi import OpCompletion, OpKind
from ..runtimes.base import PrimError, RuntimePrimitives
from .cache import PrefixCache


@dataclass
class HeldLease:
    """What the executor keeps of a lease it gave out (``abi.Lease`` is what it hands out)."""

    handle: int
    entry_id: int  # the cache entry it pins (0 when adopted)
    prefix: list[int]
    expires_at_tick: int
    determinism: int
    adopted: int | None = None  # a bare runtime sequence this lease hands to its admit
    taken_seq: int | None = None  # this tick's take-over: the entry's sequence, now the lane's

    @property
    def prefix_len(self) -> int:
        return len(self.prefix)


class Leases:
    def __init__(self, prim: RuntimePrimitives, cache: PrefixCache, handles: "itertools.count[int]"):
        self.prim = prim
        self.cache = cache
        self.handles = handles  # shared with logit biases: one handle space per executor
        self.live: dict[int, HeldLease] = {}
        self.bare: set[int] = set()  # adopted sequences awaiting their admit

    def lease(self, prompt: list[int], page: int, exact_only: bool, expires_at_tick: int,
              determinism: int, cache_key: int, done_ops: list[OpCompletion]) -> HeldLease | None:
        """Pin the entry sharing the longest prefix with the prompt (whole pages; exact and
        shorter than the prompt on a recurrent runtime); a keyed prompt looks among its
        key's entries first."""
        found = self.cache.longest_prefix(list(prompt), page, exact_only, cache_key)
        if found is None:
            return None
        e, n = found
        e.pins += 1
        lease = HeldLease(next(self.handles), e.entry_id, list(prompt[:n]), expires_at_tick, determinism)
        self.live[lease.handle] = lease
        done_ops.append(OpCompletion(OpKind.LEASE, lease.handle, 0, n))
        return lease

    def adopt(self, tokens: list[int], payload: object, expires_at_tick: int, determinism: int,
              done_ops: list[OpCompletion]) -> HeldLease:
        """A sequence from elsewhere (an export) becomes a bare sequence, leased for the
        admit whose prompt starts with ``tokens``."""
        seq = self.prim.seq_create()
        try:
            n = self.prim.seq_import(seq, payload)
        except PrimError:
            self.prim.seq_free(seq)
            raise
        if n != len(tokens):
            self.prim.seq_free(seq)
            raise ValueError(f"the payload holds {n} tokens, not {len(tokens)}")
        self.bare.add(seq)
        lease = HeldLease(next(self.handles), 0, list(tokens), expires_at_tick, determinism, adopted=seq)
        self.live[lease.handle] = lease
        done_ops.append(OpCompletion(OpKind.ADOPT, lease.handle, 0, n))
        return lease

    def release(self, handle: int) -> None:
        lease = self.live.pop(handle, None)
        if lease is None:
            return
        if lease.adopted is not None:
            if lease.adopted in self.bare:
                self.bare.discard(lease.adopted)
                self.prim.seq_free(lease.adopted)
        else:
            e = self.cache.get(lease.entry_id)
            if e is not None:
                e.pins = max(e.pins - 1, 0)

    def sweep(self, tick_count: int) -> None:
        for h, lease in list(self.live.items()):
            if lease.expires_at_tick < tick_count:
                self.release(h)

    def consume(self, handle: int) -> HeldLease:
        """The admit naming this lease takes it; it leaves the table (its pin is the
        admit's to give back)."""
        lease = self.live.pop(handle)
        if lease.adopted is not None:
            self.bare.discard(lease.adopted)
        return lease
