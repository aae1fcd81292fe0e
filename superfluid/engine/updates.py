"""What a scheduler step reports: per-request updates, its statistics, its errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .. import abi
from .request import Request


# A request whose grammar admits no token of the vocabulary at some point ends with this
# error: the client's doing (HTTP 400), not a server fault.
GRAMMAR_DEAD_END = "the response format's grammar admits no token of this model's vocabulary here (GRAMMAR_OVERFLOW)"


class SchedulerError(RuntimeError):
    """The executor rejected a plan: a bug on this side, not a request's fault."""


@dataclass
class RequestUpdate:
    request: Request
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[abi.LaneLogprob] = field(default_factory=list)
    finished: bool = False


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


# A token picked inside a running tick, with its logprob, for the engine to stream now.
TokenCallback = Callable[[Request, int, "abi.LaneLogprob | None"], None]

def update_of(updates: dict[int, RequestUpdate], req: Request) -> RequestUpdate:
    return updates.setdefault(id(req), RequestUpdate(req))
