"""What the last tick's memory counters say of the pool: the free cells admissions may
plan with, and the bytes of keyed cache entries the plans protect.

The estimate is taken before the tick's retires gave cells back, so it errs short;
None means the runtime does not count cells and ``NeedsReplan`` decides alone.
"""

from __future__ import annotations

from .. import abi
from . import cache_keys
from .config import SchedulerConfig
from .updates import SchedulerStats


class PoolEstimate:
    def __init__(self, config: SchedulerConfig, desc, stats: SchedulerStats):
        self.config, self.desc, self.stats = config, desc, stats
        self.free_cells: int | None = None
        self.protected_quota = 0  # bytes of keyed cache entries the plans protect

    def note(self, mem: abi.TickMemCounters) -> None:
        self.stats.kv_blocks_total = mem.pool_blocks_total
        self.stats.kv_blocks_used = mem.pool_blocks_used
        page, cell = self.desc.page, self.desc.cell_bytes
        pool = mem.pool_blocks_total * page * cell
        self.protected_quota = cache_keys.note_classes(self.stats.cache_bytes, mem, pool,
                                                       self.config.cache_protected_fraction)
        if mem.pool_blocks_total == 0:
            self.free_cells = None  # the runtime does not count cells: NeedsReplan decides
            return
        evictable = mem.pool_bytes_evictable // cell if cell else 0
        free = (mem.pool_blocks_total - mem.pool_blocks_used) * page + evictable
        self.free_cells = free - int(self.config.kv_watermark * mem.pool_blocks_total * page)

    def forget(self) -> None:
        """No tick will refresh it (nothing runs, or the executor was replaced)."""
        self.free_cells = None
