"""A request's lifecycle: one explicit phase, and the moves between phases allowed.

    WAITING ──admit──> PREFILLING ──prefilled──> DECODING
       │                  │  ▲                      │
       │                  │  └──────admit─────┐     │
       │                  └──preempt / fault──> PREEMPTED <──┘
       │                                        │
       └──────────── end (any phase above) ──> ENDING ──settle──> RETIRING ──retired──> FINISHED
                                                          └──(no lane)───────────────────┘

- WAITING: queued, never admitted.
- PREFILLING / DECODING: a lane holds it; its history is (not yet) all prefilled.
- PREEMPTED: it held a lane and gave it up (preempted, a tentative OOM fault, a lost
  worker); queued to be re-admitted with its tokens decode-replayed.
- ENDING: a verdict ended it in this step (the Finisher's, an abort, an error): it takes
  no more tokens, but its handles stay while the step runs; its lane, if it has one,
  may retire already.
- RETIRING: finished (handles released, its last delta out); its lane retires next tick.
- FINISHED: finished, and it holds no lane.

Only ``RequestTable.apply`` (request_table.py) moves a request, through ``move``, which
refuses a move this table does not allow.
"""

from __future__ import annotations

import enum


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    ENDING = "ending"
    RETIRING = "retiring"
    FINISHED = "finished"


P = Phase
ALLOWED: dict[Phase, frozenset[Phase]] = {
    P.WAITING: frozenset({P.PREFILLING, P.DECODING, P.ENDING}),
    P.PREEMPTED: frozenset({P.PREFILLING, P.DECODING, P.ENDING}),
    P.PREFILLING: frozenset({P.DECODING, P.PREEMPTED, P.ENDING}),
    P.DECODING: frozenset({P.PREEMPTED, P.ENDING}),
    P.ENDING: frozenset({P.RETIRING, P.FINISHED}),
    P.RETIRING: frozenset({P.FINISHED}),
    P.FINISHED: frozenset(),
}
QUEUED = frozenset({P.WAITING, P.PREEMPTED})  # in the waiting queue
LIVE = frozenset({P.PREFILLING, P.DECODING})  # a lane holds it and it goes on
TAKES_TOKENS = QUEUED | LIVE  # a token that reaches it counts
ENDED = frozenset({P.RETIRING, P.FINISHED})  # its end is settled
RETIRES = frozenset({P.ENDING, P.RETIRING})  # a lane it holds retires in the next plan


class LifecycleError(RuntimeError):
    """A move the lifecycle does not allow: a bug on this side."""


def check(old: Phase, new: Phase) -> None:
    if new is not old and new not in ALLOWED[old]:
        raise LifecycleError(f"a request cannot go from {old.value} to {new.value}")
