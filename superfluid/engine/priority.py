"""Which request is served first, and which running lane gives way.

vLLM's semantics: ``priority`` lower is served first, FCFS (arrival) among equals.
Under the ``priority`` policy a waiting request of strictly better priority than
the worst running one preempts it when the batch or the pool is full (the victim
is retired without publishing and re-admitted later with ``decode_replay`` and
the same rng base, so it ends with the text it would have had). Under ``fcfs``
priority plays no part.

Aging (``aging_s`` > 0) keeps anything from starving: each ``aging_s`` seconds a
request has existed counts as one level better. It is measured from arrival, for
waiting and running requests alike, so a preempted request keeps its age and an
old request eventually outranks any newcomer.

Invariant: keys are (effective priority, arrival); a smaller key is better. Equal
priorities never preempt each other (the victim must be strictly worse), so
preemption cannot thrash between equals.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

from .request import Request

POLICIES = ("priority", "fcfs")


@dataclass(frozen=True)
class PriorityPolicy:
    kind: str = "priority"
    aging_s: float = 0.0

    def __post_init__(self):
        if self.kind not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.kind!r} (choose from {', '.join(POLICIES)})")

    @property
    def preempts(self) -> bool:
        return self.kind == "priority"

    def level(self, req: Request, now: float) -> float:
        if self.kind == "fcfs":
            return 0.0
        level = float(req.params.priority)
        if self.aging_s > 0:
            level -= (now - req.arrival) / self.aging_s
        return level

    def key(self, req: Request, now: float | None = None) -> tuple[float, float]:
        now = time.monotonic() if now is None else now
        return (self.level(req, now), req.arrival)

    def order(self, waiting: list[Request]) -> None:
        """Sort the queue in place, best first (stable: FCFS among equals)."""
        now = time.monotonic()
        waiting.sort(key=lambda r: self.key(r, now))

    def worst(self, running: Iterable[Request]) -> Request | None:
        """The running request to give way first: worst priority, newest among equals."""
        now = time.monotonic()
        return max(running, key=lambda r: self.key(r, now), default=None)

    def victims(self, running: Iterable[Request], candidate: Request) -> list[Request]:
        """Running requests strictly worse than ``candidate``, worst first."""
        if not self.preempts:
            return []
        now = time.monotonic()
        level = self.level(candidate, now)
        worse = [r for r in running if self.level(r, now) > level]
        return sorted(worse, key=lambda r: self.key(r, now), reverse=True)
