"""The prefix cache: sequences kept after their lane ended, keyed by their tokens.

Invariants:
- An entry is either resident (``seq`` is a live runtime sequence holding exactly
  ``len(tokens)`` tokens, or more when a truncate failed) or exported (``seq`` is None and
  ``exported`` holds the payload in host memory).
- ``pins`` counts the leases naming the entry; a pinned entry is never evicted.
- Keys are whole pages on a paged runtime and exact token lists on a recurrent one.
- Keyed entries (a request's ``prompt_cache_key``, hashed to ``key``) are **protected**
  while they fit the plan's protected quota, most recently used first: eviction never
  picks a protected entry (unless nothing else is live: see capacity.py), so a burst of
  unkeyed traffic cannot push a keyed prefix out. Past the quota a keyed entry is an
  entry like the others (least recently used first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

# An entry a lease copies at least this much of (or whole) counts as used: the chat
# template's opening tokens, which every prompt shares, do not keep an entry warm.
REAL_USE_TOKENS = 32


@dataclass
class CacheEntry:
    entry_id: int
    seq: int | None
    tokens: list[int]
    prompt: int  # prompt length of the lane that published it (the next turn covers it)
    bytes: int
    last_used: int  # tick
    pins: int = 0
    exported: object | None = None
    shared: bool = False  # a fork copied from it: kept for its siblings
    leased: int = 0  # leases served (copies made of it)
    key: int = 0  # prompt_cache_key's hash; 0: unkeyed
    retention: int = 0  # Retention: NONE (unkeyed), IN_MEMORY, EXTENDED (24h: exported first, dropped last)

    def share(self, n_tokens: int) -> bool:
        """A lease copied n tokens; True if that is a real use of the entry."""
        self.shared = True
        return n_tokens >= min(REAL_USE_TOKENS, len(self.tokens))


class Retention:
    NONE = 0
    IN_MEMORY = 1
    EXTENDED = 2  # "24h"
    NAMES = {NONE: "none", IN_MEMORY: "in_memory", EXTENDED: "24h"}


class PrefixCache:
    def __init__(self) -> None:
        self.entries: list[CacheEntry] = []
        self._next_id = 1

    def __iter__(self) -> Iterator[CacheEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def insert(self, seq: int, tokens: list[int], prompt: int, nbytes: int, now: int, key: int = 0,
               retention: int = 0) -> CacheEntry:
        e = CacheEntry(self._next_id, seq, tokens, prompt, nbytes, now, key=key, retention=retention if key else 0)
        self._next_id += 1
        self.entries.append(e)
        return e

    def get(self, entry_id: int) -> CacheEntry | None:
        for e in self.entries:
            if e.entry_id == entry_id:
                return e
        return None

    def by_seq(self, seq: int) -> CacheEntry | None:
        for e in self.entries:
            if e.seq == seq:
                return e
        return None

    def find_tokens(self, tokens: list[int]) -> CacheEntry | None:
        for e in self.entries:
            if e.tokens == tokens:
                return e
        return None

    def remove(self, entry_id: int) -> CacheEntry | None:
        for i, e in enumerate(self.entries):
            if e.entry_id == entry_id:
                return self.entries.pop(i)
        return None

    def resident(self) -> list[CacheEntry]:
        return [e for e in self.entries if e.seq is not None]

    def resident_bytes(self) -> int:
        return sum(e.bytes for e in self.entries if e.seq is not None)

    def exported_bytes(self, retention: int | None = None) -> int:
        return sum(e.bytes for e in self.entries if e.seq is None and (retention is None or e.retention == retention))

    def unpinned_bytes(self, protected: frozenset[int] = frozenset()) -> int:
        return sum(e.bytes for e in self.entries if e.seq is not None and e.pins == 0 and e.entry_id not in protected)

    def protected(self, quota_bytes: int) -> frozenset[int]:
        """Keyed resident entries that fit the quota, most recently used first."""
        out, spent = set(), 0
        for e in sorted((e for e in self.entries if e.key and e.seq is not None), key=lambda e: (-e.last_used, -e.entry_id)):
            if spent + e.bytes > quota_bytes:
                continue
            out.add(e.entry_id)
            spent += e.bytes
        return frozenset(out)

    def eviction_order(self, protected: frozenset[int] = frozenset()) -> list[CacheEntry]:
        """Resident, unpinned, unprotected entries, least recently used first (oldest entry on ties)."""
        return sorted(
            (e for e in self.entries if e.seq is not None and e.pins == 0 and e.entry_id not in protected),
            key=lambda e: (e.last_used, e.entry_id),
        )

    def plan_evict_until(
        self, cap_bytes: int, enough: Callable[[list[CacheEntry]], bool], protected: frozenset[int] = frozenset()
    ) -> tuple[list[CacheEntry], bool]:
        """Pick LRU victims, at most cap_bytes of them, until ``enough(picked)``.
        Picks nothing for real: the caller makes them leave the pool."""
        picked: list[CacheEntry] = []
        spent = 0
        if enough(picked):
            return picked, True
        for e in self.eviction_order(protected):
            if spent + e.bytes > cap_bytes:
                continue
            picked.append(e)
            spent += e.bytes
            if enough(picked):
                return picked, True
        return picked, False

    def longest_prefix(self, prompt: list[int], page: int, exact_only: bool, key: int = 0) -> tuple[CacheEntry, int] | None:
        """The entry sharing the longest prefix with the prompt and that prefix's length.

        Paged: any whole-page prefix of an entry will do (a copy takes part of it).
        Recurrent: the whole entry must be a prefix, shorter than the prompt (a state
        cannot be cut, and the prompt's last token is fed by the first decode).
        A keyed prompt is routed to its key's entries first, then to any."""
        if key:
            found = self._longest(prompt, page, exact_only, [e for e in self.entries if e.key == key])
            if found is not None:
                return found
        return self._longest(prompt, page, exact_only, self.entries)

    @staticmethod
    def _longest(prompt: list[int], page: int, exact_only: bool, entries: list[CacheEntry]) -> tuple[CacheEntry, int] | None:
        best: tuple[CacheEntry, int] | None = None
        for e in entries:
            if exact_only:
                n = len(e.tokens)
                if n == 0 or n >= len(prompt) or prompt[:n] != e.tokens:
                    continue
            else:
                n = _common_prefix(e.tokens, prompt) // page * page
                if n == 0:
                    continue
            if best is None or n > best[1] or (n == best[1] and e.last_used > best[0].last_used):
                best = (e, n)
        return best


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    # compare in slices first: prompts share long prefixes
    step = 64
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i
