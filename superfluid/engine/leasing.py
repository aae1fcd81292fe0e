"""A step's prefix leases: at most one per request across the step's re-plans, taken
only for a request the planner has decided to admit if it fits (after the batch,
priority and fork checks), and what the accepted tick did not use goes back when the
step ends (``with StepLeases(...)``, whatever ended the step).

A lease pins its cache entry, so one a request leased but was not admitted with is
released at once, not at its TTL (the pool must stay evictable). An adopted lease (a
handed-over lane's KV) stays with its request until an admit takes it.
"""

from __future__ import annotations

from .. import abi
from .config import SchedulerConfig
from .request import Request


class StepLeases:
    def __init__(self, executor, config: SchedulerConfig, batch_invariant: bool, waiting: list[Request]):
        self.ex, self.config, self.batch_invariant = executor, config, batch_invariant
        self._waiting = waiting  # the queue, read at the end: adopted leases stay with who waits
        self._leases: dict[int, abi.Lease | None] = {}  # id(request) -> its lease this step
        self.used: set[int] = set()  # lease handles the accepted tick's admits consumed

    def __call__(self, req: Request) -> abi.Lease | None:
        """The prefix ``req`` may start from (None: it prefills from the start)."""
        if req.params.prompt_logprobs is not None:
            return None  # every prompt token is scored from a row of its own prefill
        if req.handles.adopted is not None:  # a handed-over lane's KV, adopted for it
            self._leases[id(req)] = req.handles.adopted
            return req.handles.adopted
        if not self.batch_invariant and req.index == 0 and req.params.seed is not None:
            # A cached prefix was computed along another path (chunking, batch company):
            # on a runtime whose rows depend on that, a seeded request prefills afresh so
            # that it gives the same text on every call. Its own forks still share its prompt.
            return None
        if id(req) not in self._leases:
            got = self.ex.lease_prefix(
                req.history, ttl_ticks=self.config.lease_ttl_ticks, determinism_class=self.config.determinism_class,
                cache_key=req.cache_key,
            )
            self._leases[id(req)] = got if got and got.prefix_len > 0 else None
        return self._leases[id(req)]

    def consumed(self, admissions) -> None:
        """The executor accepted a tick with these admissions: their leases are spent."""
        self.used.update(a.lease.handle for a in admissions if a.lease is not None)

    def __enter__(self) -> StepLeases:
        return self

    def __exit__(self, *exc) -> None:
        waiting = self._waiting
        for lease in self._leases.values():
            if lease is not None and lease.handle not in self.used and not any(r.handles.adopted is lease for r in waiting):
                self.ex.release_lease(lease.handle)
