"""Host-side sampling jobs: HOST lanes' rows out, their callbacks on threads, tokens back.

A request with logits processors or a sampler runs on a HOST lane. Each tick that
decodes it, the executor sends its row across the logits ring with a nonce (the
row's generation); ``submit`` copies it before the next tick reuses the ring and
runs ``host_pick.pick`` on a thread pool; ``collect`` hands back the picks that
answered, which the scheduler accepts as the request's next token and commits with
the nonce in the next plan. Every other lane keeps engine-side sampling.

Invariants:
- At most one row per request is out (``Request.host_row_out``); the planner does
  not decode a lane whose row is out, so a slow callback holds back its own lane
  only: it is committed in a later tick while the others go on.
- A pick counts only if its request still holds the lane the row came from, at the
  same position, and is not finished; otherwise (preempted, worker lost, aborted,
  a stop string) it is dropped: a re-admitted lane sends that position's row again.
- Crash replay and preemption: tokens already accepted are in the request's history
  and are decode-replayed *without* calling the callbacks again; only a row whose
  callbacks had not answered is computed again, and they are called again for it.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass

import numpy as np

from .host_pick import PickInput, Picked, pick
from .request import Request


@dataclass(eq=False)
class _Job:
    req: Request
    lane_tag: int
    nonce: int
    position: int
    future: cf.Future
    fresh: bool = True  # sent out by the last tick: worth a short wait


class HostSampler:
    def __init__(self, threads: int = 4, grace_s: float = 0.05):
        self.threads = max(1, threads)
        self.grace_s = grace_s
        self._pool: cf.ThreadPoolExecutor | None = None  # started with the first row
        self._jobs: list[_Job] = []

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def submit(self, req: Request, lane_tag: int, nonce: int, row: np.ndarray) -> None:
        """``row`` must be the request's own copy (the ring is rewritten next tick)."""
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(self.threads, thread_name_prefix="superfluid-host")
        inp = PickInput(req.params, tuple(req.prompt_token_ids), tuple(req.output_token_ids), row, req.rng_base)
        req.host_row_out = True
        self._jobs.append(_Job(req, lane_tag, nonce, len(req.output_token_ids), self._pool.submit(pick, inp)))

    def wait(self, idle: bool) -> None:
        """Before a plan: give the rows the last tick sent out ``grace_s`` to come back,
        so that quick callbacks commit in the very next tick. ``idle`` (nothing else to
        run): wait for any one pick, a little longer, instead of spinning."""
        if not self._jobs:
            return
        if idle:
            cf.wait([j.future for j in self._jobs], timeout=max(self.grace_s, 0.05), return_when=cf.FIRST_COMPLETED)
            return
        fresh = [j.future for j in self._jobs if j.fresh]
        if fresh and self.grace_s > 0:
            cf.wait(fresh, timeout=self.grace_s)
        for j in self._jobs:
            j.fresh = False

    def collect(self) -> list[tuple[Request, int, int, Picked | BaseException]]:
        """(request, lane tag, nonce, pick or the error) for each pick that answered
        and still counts; picks that no longer count are dropped."""
        done, keep = [], []
        for j in self._jobs:
            if not j.future.done():
                keep.append(j)
                continue
            req = j.req
            if req.lane_tag != j.lane_tag or not req.takes_tokens or len(req.output_token_ids) != j.position:
                continue  # the lane it came from is gone (see the invariants)
            req.host_row_out = False
            err = j.future.exception()
            done.append((req, j.lane_tag, j.nonce, err if err is not None else j.future.result()))
        self._jobs = keep
        return done

    def forget(self, req: Request) -> None:
        """The request lost its lane (preempted, requeued): any row out is void."""
        req.host_row_out = False
        req.host_commit = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        self._jobs = []
