"""Which replica a request goes to.

1. A ``prompt_cache_key``: the consistent-hash ring with bounded load on the key.
2. Else the deepest leading page of the prompt that an earlier request was routed
   with: its replica holds those pages in its prefix cache (a multi-turn conversation,
   a shared system prompt) -- unless that replica is over the load bound, then the
   ring from that page's hash.
3. Else the least loaded replica.

Pages are hashed as a chain (each page's hash covers every token before it), so a
match on page k means the whole prefix up to k matches. The page table is an LRU of
bounded size and forgets a replica that leaves (its cache went with it).

The router is plain data, driven by the front door's event loop (no locks) and by the
simulation in benchmarks/ (no Ray).
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass

from .hashring import HashRing, bounded_load, hash64

KINDS = ("cache_key", "prefix_hit", "prefix_spill", "least_loaded")


def page_hashes(tokens: list[int], page: int, max_pages: int) -> list[int]:
    """The chained hash of each whole leading page (at most ``max_pages``)."""
    out: list[int] = []
    h = 0
    for k in range(min(len(tokens) // page, max_pages)):
        chunk = tokens[k * page : (k + 1) * page]
        h = hash64(struct.pack(f"<Q{len(chunk)}q", h, *chunk))
        out.append(h)
    return out


@dataclass
class Route:
    replica: str
    kind: str  # one of KINDS
    matched_pages: int = 0


@dataclass
class RouterConfig:
    page: int = 16  # tokens per routing page: the runtime's KV page
    min_match_tokens: int = 32  # a shorter shared prefix (a chat template's opening) routes nothing
    max_pages: int = 256  # pages hashed per prompt
    load_factor: float = 1.25  # c of the load bound
    load_slack: int = 1  # a cache hit may run this many requests past the bound (small loads would spread at once)
    table_size: int = 1 << 16  # remembered pages


class Router:
    def __init__(self, config: RouterConfig = RouterConfig(), policy: str = "prefix"):
        self.config = config
        self.policy = policy  # "prefix" (the server's), "round_robin", "least_loaded": the simulation compares them
        self.ring = HashRing()
        self.up: set[str] = set()
        self.load: collections.Counter[str] = collections.Counter()
        self.routed: dict[str, collections.Counter[str]] = {}
        self._pages: collections.OrderedDict[int, str] = collections.OrderedDict()
        self._rr = 0

    # ------------------------------------------------------------ membership
    def add(self, replica: str) -> None:
        self.ring.add(replica)
        self.up.add(replica)
        self.routed.setdefault(replica, collections.Counter())

    def set_up(self, replica: str, up: bool) -> None:
        """A replica that is down (lost, restarting) or draining takes no new request;
        it stays on the ring so that its keys come back to it once it is up again.
        Its pages are forgotten: a restarted replica's cache is empty."""
        if up:
            self.up.add(replica)
            return
        self.up.discard(replica)
        for h in [h for h, r in self._pages.items() if r == replica]:
            del self._pages[h]

    # ------------------------------------------------------------ routing
    def route(self, tokens: list[int], cache_key: str | None = None, exclude: frozenset[str] = frozenset()) -> Route | None:
        allowed = [r for r in self.ring.members if r in self.up and r not in exclude]
        if not allowed:
            return None
        if self.policy == "round_robin":
            self._rr += 1
            return self._count(Route(allowed[self._rr % len(allowed)], "least_loaded"))
        if self.policy == "least_loaded":
            return self._count(Route(self._least(allowed), "least_loaded"))
        ok = lambda r: r in self.up and r not in exclude  # noqa: E731
        if cache_key is not None:
            return self._count(Route(self.ring.pick(hash64(cache_key.encode()), self.load.__getitem__,
                                                    self.config.load_factor, ok), "cache_key"))
        hashes = page_hashes(tokens, self.config.page, self.config.max_pages)
        min_depth = max(1, -(-self.config.min_match_tokens // self.config.page))
        for depth in range(len(hashes), min_depth - 1, -1):
            owner = self._pages.get(hashes[depth - 1])
            if owner is None or not ok(owner):
                continue
            bound = bounded_load(sum(self.load[r] for r in allowed), len(allowed), self.config.load_factor)
            if self.load[owner] < bound + self.config.load_slack:
                return self._count(Route(owner, "prefix_hit", depth))
            spill = self.ring.pick(hashes[depth - 1], self.load.__getitem__, self.config.load_factor, ok)
            return self._count(Route(spill, "prefix_spill", depth))
        return self._count(Route(self._least(allowed), "least_loaded"))

    def _least(self, allowed: list[str]) -> str:
        return min(allowed, key=lambda r: (self.load[r], r))

    def _count(self, route: Route) -> Route:
        self.routed.setdefault(route.replica, collections.Counter())[route.kind] += 1
        return route

    # ------------------------------------------------------------ accounting
    def placed(self, replica: str, tokens: list[int]) -> None:
        """A request runs on ``replica`` from now on: its pages will be in that cache."""
        self.load[replica] += 1
        self.remember(replica, tokens)

    def remember(self, replica: str, tokens: list[int]) -> None:
        """The replica's cache holds these pages now (a finished history, published)."""
        for h in page_hashes(tokens, self.config.page, self.config.max_pages):
            self._pages[h] = replica
            self._pages.move_to_end(h)
        while len(self._pages) > self.config.table_size:
            self._pages.popitem(last=False)

    def left(self, replica: str) -> None:
        """A request placed on ``replica`` finished there or moved away."""
        if self.load[replica] > 0:
            self.load[replica] -= 1
