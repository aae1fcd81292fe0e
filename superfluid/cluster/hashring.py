"""Consistent hashing with bounded load (Mirrokni, Thorup, Zadimoghaddam 2018).

Each member owns ``vnodes`` points on a 64-bit ring. A key goes to the first member
clockwise from its hash whose load is under the bound ``ceil(c * (total + 1) / n)``:
a key keeps its member while that member is not overloaded, and a member that leaves
moves only its own keys (to their next members).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from typing import Callable, Iterable, Iterator


def hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class HashRing:
    def __init__(self, members: Iterable[str] = (), vnodes: int = 64):
        self.vnodes = vnodes
        self._points: list[int] = []
        self._owner: list[str] = []
        self.members: list[str] = []
        for m in members:
            self.add(m)

    def add(self, member: str) -> None:
        if member in self.members:
            return
        self.members.append(member)
        for v in range(self.vnodes):
            p = hash64(f"{member}#{v}".encode())
            i = bisect.bisect(self._points, p)
            self._points.insert(i, p)
            self._owner.insert(i, member)

    def remove(self, member: str) -> None:
        if member not in self.members:
            return
        self.members.remove(member)
        keep = [(p, o) for p, o in zip(self._points, self._owner) if o != member]
        self._points = [p for p, _ in keep]
        self._owner = [o for _, o in keep]

    def walk(self, key: int) -> Iterator[str]:
        """Every member once, in ring order from the key's point."""
        if not self._points:
            return
        seen: set[str] = set()
        start = bisect.bisect(self._points, key)
        n = len(self._points)
        for k in range(n):
            m = self._owner[(start + k) % n]
            if m not in seen:
                seen.add(m)
                yield m
                if len(seen) == len(self.members):
                    return

    def pick(self, key: int, load: Callable[[str], int], c: float = 1.25,
             allowed: Callable[[str], bool] = lambda m: True) -> str | None:
        """The first allowed member from the key under the load bound (else the first allowed)."""
        members = [m for m in self.members if allowed(m)]
        if not members:
            return None
        bound = bounded_load(sum(load(m) for m in members), len(members), c)
        first = None
        for m in self.walk(key):
            if not allowed(m):
                continue
            first = first or m
            if load(m) < bound:
                return m
        return first


def bounded_load(total: int, n: int, c: float) -> int:
    """The most requests a member may hold once one more arrives."""
    return max(1, math.ceil(c * (total + 1) / max(n, 1)))
