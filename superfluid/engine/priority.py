"""Which request is served first, and which running lane gives way.

vLLM's semantics: ``priority`` lower is served first, FCFS (arrival) among equals.
Under the ``priority`` policy a waiting request of strictly better priority than
the worst running one preempts it when the batch or the pool is full (the victim
is retired without publishing and re-admitted later with ``decode_replay`` and
the same rng base, so it ends with the text it would have had). Under ``fcfs``
priority plays no part.

Aging (``aging_s`` > 0) keeps anything from starving: each ``aging_s`` seconds a
request has existed counts as one level better, for waiting and running requests
alike (a preempted request keeps its age). Two requests' levels then differ by the
same amount at every moment, so the order is static: it is the order of
``priority * aging_s + arrival``, a virtual deadline, and an old request outranks
every newcomer whose priority is not better by more than its head start.

Invariant: keys are (level, arrival); a smaller key is better. Equal levels never
preempt each other (the victim must be strictly worse), and the order never changes
while requests wait, so preemption cannot thrash.
"""

from __future__ import annotations

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

    def level(self, req: Request) -> float:
        if self.kind == "fcfs":
            return 0.0
        if self.aging_s > 0:
            return req.params.priority + req.arrival / self.aging_s  # the level at any moment, plus a constant
        return float(req.params.priority)

    def key(self, req: Request) -> tuple[float, float]:
        return (self.level(req), req.arrival)

    def order(self, waiting: list[Request]) -> None:
        """Sort the queue in place, best first (stable: FCFS among equals)."""
        waiting.sort(key=self.key)

    def worst(self, running: Iterable[Request]) -> Request | None:
        """The running request to give way first: worst priority, newest among equals."""
        return max(running, key=self.key, default=None)

    def victims(self, running: Iterable[Request], candidate: Request) -> list[Request]:
        """Running requests strictly worse than ``candidate``, worst first."""
        if not self.preempts:
            return []
        level = self.level(candidate)
        return sorted((r for r in running if self.level(r) > level), key=self.key, reverse=True)
