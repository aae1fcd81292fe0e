"""What the scheduler reports: its statistics and its errors."""

from __future__ import annotations

from dataclasses import dataclass, field


# A request whose grammar admits no token of the vocabulary at some point ends with this
# error: the client's doing (HTTP 400), not a server fault.
GRAMMAR_DEAD_END = "the response format's grammar admits no token of this model's vocabulary here (GRAMMAR_OVERFLOW)"


class SchedulerError(RuntimeError):
    """The executor rejected a plan: a bug on this side, not a request's fault."""


@dataclass
class SchedulerStats:
    ticks: int = 0
    replans: int = 0
    preemptions: int = 0
    prefix_hit_tokens: int = 0  # prompt tokens leases covered, over every admission
    prompt_tokens: int = 0  # prompt tokens admitted for the first time
    generation_tokens: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    # per retention class ("none", "in_memory", "24h"): admissions a lease served, and the
    # cache's resident / protected / exported bytes after the last tick
    cache_hits: dict = field(default_factory=dict)
    cache_bytes: dict = field(default_factory=dict)

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
