"""A decode round's bookkeeping and the reference's row order.

A row is processed as the reference orders it: grammar mask (the caller), logit bias,
penalties (last 64 tokens, specials exempt), then greedy or a draw at
rng_base + rng_counter. Verified draft rows go through the same steps, so drafts
change speed, never text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..abi import LaneLogprob, PartialEmit, Sampling, TickFlag
from .. import sampling as hs
from .context import TickContext
from .lane import Lane
from .tick_state import TickState


@dataclass
class Round:
    tag: int
    tokens: list[int]


@dataclass
class DecodeState:
    """Per-tick decode bookkeeping."""

    remaining: dict[int, int] = field(default_factory=dict)  # rounds left per lane
    cap_left: dict[int, int] = field(default_factory=dict)  # tokens left incl. overshoot
    out: dict[int, list[int]] = field(default_factory=dict)  # emitted this tick
    finishes: dict[int, int] = field(default_factory=dict)
    picked: dict[int, int] = field(default_factory=dict)  # tokens the runtime sampled
    spec_rows: dict[int, tuple[list[np.ndarray], list[int]]] = field(default_factory=dict)
    spec_stats: dict[int, list[int]] = field(default_factory=dict)  # [proposed, accepted]
    logprob: dict[int, LaneLogprob] = field(default_factory=dict)  # this round's, until its partial emit
    grammar_faults: list[int] = field(default_factory=list)
    faults_oob: list[int] = field(default_factory=list)  # host rows the logits ring had no room for


def greedy(lane: Lane) -> bool:
    return lane.sampling == Sampling.GREEDY or lane.params.temperature <= 0.0


def penalized(c: TickContext, lane: Lane) -> bool:
    return c.pace.penalty_exempt is not None and hs.penalizes(lane.params)


def own_row(c: TickContext, lane: Lane, row: np.ndarray) -> np.ndarray:
    """The row to pick from: a private copy when the grammar mask, bias or penalties will
    change it (a runtime's row may be a view of its batch), else the row itself --
    argmax, sampling and logprobs only read it."""
    if lane.grammar is not None or lane.bias is not None or lane.rules is not None or penalized(c, lane):
        return np.array(row, dtype=np.float32, copy=True)
    return row


def process_row(c: TickContext, lane: Lane, row: np.ndarray) -> None:
    """Token rules, bias and penalties in place, in the reference's order (the grammar
    mask comes first; the rules only ban, so they sit with it)."""
    if lane.rules is not None:
        lane.rules.apply(row, lane.committed, lane.out_start)
    if lane.bias is not None:
        hs.apply_logit_bias(row, lane.bias)
    if penalized(c, lane):
        hs.apply_penalties(row, lane.committed[-hs.PENALTY_WINDOW :], lane.params, c.pace.penalty_exempt)


def pick(lane: Lane, row: np.ndarray) -> int:
    if greedy(lane):
        return hs.argmax(row)
    return hs.sample(row, lane.params, hs.uniform(lane.rng_base + lane.rng_counter))


def partial(st: TickState, tag: int, token: int, logprob: LaneLogprob | None = None) -> None:
    """The token goes out at once, with its logprob, when the plan asked for partial emits."""
    if st.plan.flags & TickFlag.PARTIAL_EMITS and st.on_partial_emit is not None:
        st.on_partial_emit(PartialEmit(tag, token, logprob))


def finish(lane: Lane, dc: DecodeState, tag: int, code: int) -> None:
    dc.finishes[tag] = code
    lane.finished = True
    dc.remaining.pop(tag, None)
