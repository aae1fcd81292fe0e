"""Everything one tick's carry-out accumulates, from the first retire to the events."""

from __future__ import annotations

from dataclasses import dataclass, field
import numpy as np

from ..abi import (
    AdmitResult,
    LaneEmit,
    LaneFault,
    LaneLogprob,
    PartialEmitCallback,
    PromptLogprob,
    ShedEntry,
    ShedKind,
    TickPlan,
)
from .validate import Checked


@dataclass
class TickState:
    plan: TickPlan
    chk: Checked
    on_partial_emit: PartialEmitCallback | None
    admit_results: list[AdmitResult] = field(default_factory=list)
    faults: list[LaneFault] = field(default_factory=list)
    faulted: set[int] = field(default_factory=set)
    shed: list[ShedEntry] = field(default_factory=list)
    chunks_dropped: int = 0
    evictions: int = 0
    bytes_evicted: int = 0
    logprobs: list[LaneLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    emits: list[LaneEmit] = field(default_factory=list)
    rows: dict[int, np.ndarray] = field(default_factory=dict)  # lane -> row waiting to be sampled
    yielded: bool = False  # the prefill stopped early on a yield
    commit_finishes: dict[int, int] = field(default_factory=dict)  # host lane -> Finish its commit ended it with
    prefill_ns: int = 0
    decode_ns: int = 0

    def evicted(self, lane_tag: int, nbytes: int, tokens: int) -> None:
        self.shed.append(ShedEntry(lane_tag, ShedKind.CACHE_EVICTION, 0, nbytes, tokens))
        self.evictions += 1
        self.bytes_evicted += nbytes

    def dropped(self, lane_tag: int, tokens: int) -> None:
        self.shed.append(ShedEntry(lane_tag, ShedKind.PREFILL_CHUNK, 0, 0, tokens))
        self.chunks_dropped += 1
