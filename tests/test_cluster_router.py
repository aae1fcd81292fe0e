"""The router and its ring without Ray: consistent hashing keeps keys, bounds load,
moves only a leaving member's keys; prefix routing follows cached pages."""

from __future__ import annotations

import collections

from superfluid.cluster.hashring import HashRing, bounded_load, hash64
from superfluid.cluster.router import Router, RouterConfig, page_hashes


def test_ring_moves_only_the_leaving_members_keys():
    ring = HashRing([f"r{i}" for i in range(8)])
    keys = [hash64(str(k).encode()) for k in range(2000)]
    before = {k: next(ring.walk(k)) for k in keys}
    ring.remove("r3")
    after = {k: next(ring.walk(k)) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "r3" for k in moved)
    assert collections.Counter(before.values())["r3"] == len(moved)


def test_ring_bounds_load():
    ring = HashRing(["a", "b", "c"])
    load = collections.Counter()
    for _ in range(30):  # one hot key: spills once its member reaches the bound
        m = ring.pick(hash64(b"hot"), load.__getitem__, c=1.25)
        load[m] += 1
    assert max(load.values()) <= bounded_load(29, 3, 1.25)
    assert len(load) == 3


def test_page_hashes_chain():
    a = page_hashes(list(range(40)), 8, 100)
    b = page_hashes(list(range(16)) + [99] + list(range(17, 40)), 8, 100)
    assert len(a) == 5 and a[:2] == b[:2] and a[2] != b[2] and a[3] != b[3]  # a change moves every later page


def test_shared_prefix_follows_its_replica_then_spills_under_load():
    r = Router(RouterConfig(page=4, min_match_tokens=8, load_factor=1.25))
    for n in ("r0", "r1", "r2"):
        r.add(n)
    system = list(range(100, 140))
    first = r.route(system + [1, 2, 3])
    assert first.kind == "least_loaded"
    r.placed(first.replica, system + [1, 2, 3])
    second = r.route(system + [7, 8, 9])
    assert second.replica == first.replica and second.kind == "prefix_hit" and second.matched_pages == 10
    r.placed(second.replica, system + [7, 8, 9])
    kinds = []
    for k in range(6):  # the same prefix keeps coming: its replica fills past the bound, then it spills
        got = r.route(system + [k])
        kinds.append(got.kind)
        r.placed(got.replica, system + [k])
    assert "prefix_spill" in kinds and kinds[0] == "prefix_hit"
    loads = [r.load[n] for n in ("r0", "r1", "r2")]
    assert max(loads) <= bounded_load(sum(loads) - 1, 3, 1.25) + 1  # the bound, plus the hit's slack
    other = r.route(list(range(500, 540)))
    assert other.kind == "least_loaded" and r.load[other.replica] == min(r.load[n] for n in ("r0", "r1", "r2"))


def test_cache_key_is_sticky_and_a_lost_replica_is_forgotten():
    r = Router(RouterConfig(page=4))
    for n in ("r0", "r1"):
        r.add(n)
    a = r.route([1], cache_key="tenant-7")
    assert all(r.route([2], cache_key="tenant-7").replica == a.replica for _ in range(5))
    r.placed(a.replica, list(range(64)))
    r.set_up(a.replica, False)
    assert r.route(list(range(64))).replica != a.replica
    assert r.route([1], cache_key="tenant-7").replica != a.replica
    assert r.route([1], cache_key="x", exclude=frozenset({"r0", "r1"})) is None
