"""One running generation inside the executor."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..abi import RingRef, LaneParams


@dataclass
class Lane:
    seq: int  # the runtime sequence holding this lane's state
    sampling: int
    params: LaneParams
    rng_base: int
    prompt: list[int]
    prefill_end: int  # prompt tokens that go through prefill; the rest are decode-replayed
    prefilled: int  # prompt tokens prefilled so far (a lease's prefix counts)
    # Invariant: committed is the prompt's prefix followed by what the lane emitted.
    # The runtime has ingested all of it but pending_input.
    committed: list[int] = field(default_factory=list)
    pending_input: int | None = None  # held back: the next step feeds it
    pending_logits: RingRef | None = None  # host lanes: the row sent out, awaiting a commit
    rng_counter: int = 0
    finished: bool = False
    bias: tuple[np.ndarray, np.ndarray] | None = None
    rules: object | None = None  # token_rules.TokenRules
    out_start: int = 0  # committed[out_start:] is what the lane generated (its replay included)
    logprobs_top: int | None = None  # top-k logprobs wanted (0: the chosen token's only)
    grammar: object | None = None  # grammar.LaneGrammar
    spec: object | None = None  # speculate.LaneSpec
    publish_prompt: bool = False  # cache the prompt once prefilled (forks share it)
    prompt_logprobs_top: int | None = None  # prompt tokens scored from the prefill's rows
    cache_key: int = 0  # what the lane publishes carries these (prompt_cache_key)
    cache_retention: int = 0

    def ingested(self) -> int:
        return len(self.committed) - (self.pending_input is not None)
