"""``prompt_cache_key`` / ``prompt_cache_retention`` -> what the executor's cache keeps.

A request that names a key (or a retention: it is then keyed by the empty key) is
routed to its key's cache entries first, and what its lane publishes carries the key:
such entries are protected within the protected quota (a share of the pool), so other
traffic cannot evict them. ``in_memory`` entries that must leave the pool anyway are
treated as unkeyed ones are (exported while host memory has room, dropped first);
``24h`` entries are exported first and dropped from host memory last, and a hit imports
them back.
"""

from __future__ import annotations

import hashlib

from ..executor.cache import Retention
from .errors import ParamError

RETENTIONS = {"in_memory": Retention.IN_MEMORY, "24h": Retention.EXTENDED}
MAX_KEY_CHARS = 1024


def check(key: str | None, retention: str | None) -> None:
    if key is not None and len(key) > MAX_KEY_CHARS:
        raise ParamError(f"prompt_cache_key must be at most {MAX_KEY_CHARS} characters", "prompt_cache_key")
    if retention is not None and retention not in RETENTIONS:
        raise ParamError(f"prompt_cache_retention must be one of {', '.join(RETENTIONS)}, got {retention!r}",
                         "prompt_cache_retention")


def key_hash(key: str | None, retention: str | None) -> int:
    """A nonzero 63-bit hash (0: unkeyed)."""
    if key is None and retention is None:
        return 0
    h = int.from_bytes(hashlib.blake2b((key or "").encode(), digest_size=8).digest(), "little") >> 1
    return h or 1


def retention_class(key: str | None, retention: str | None) -> int:
    if key is None and retention is None:
        return Retention.NONE
    return RETENTIONS.get(retention or "in_memory", Retention.IN_MEMORY)


def class_name(key: str | None, retention: str | None) -> str:
    return Retention.NAMES[retention_class(key, retention)]


# ------------------------------------------------------------------ the scheduler's side


def count_hit(hits: dict[str, int], retention: int) -> None:
    name = Retention.NAMES.get(retention, "none")
    hits[name] = hits.get(name, 0) + 1


def note_classes(out: dict, mem, pool_bytes: int, fraction: float) -> int:
    """Record per-class (resident, protected, exported) bytes from a tick's memory
    counters; return the next plans' protected quota: keyed entries are kept up to a
    share of the pool and never more than they hold (the quota also keeps that much
    cache resident, which unkeyed entries must not be given)."""
    keyed = 0
    for c in mem.cache_classes:
        out[Retention.NAMES.get(c.retention, str(c.retention))] = (c.resident_bytes, c.protected_bytes, c.exported_bytes)
        if c.retention != Retention.NONE:
            keyed += c.resident_bytes
    return min(int(pool_bytes * fraction), keyed)
