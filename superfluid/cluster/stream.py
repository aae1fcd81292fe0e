"""One request's stream at the front door, from whichever replica runs it.

It keeps, per choice, the tokens it has passed on and the choice's rng base -- all it
needs to move the request: off a lost replica (any Ray error mid-stream) by re-admission
elsewhere with those tokens decode-replayed and the same base; off a draining replica
(its generator ends with ``HandedOver``) by adoption of the exported KV elsewhere.
Every delta a client sees was produced once: a new replica re-processes replayed
tokens silently. The request is placed on one replica at a time (the router's load).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

from ..engine.outputs import Delta
from ..engine.params import ParamError, SamplingParams
from ..engine.request import ChoiceStart
from ..engine.serving import EngineDead, QueueFull
from .handover import HandedOver

if TYPE_CHECKING:
    from .frontdoor import ClusterEngine

log = logging.getLogger("superfluid.cluster")

MAX_MOVES = 8  # replicas one request may be moved over before it fails


class ClusterStream:
    """One request's deltas, from whichever replica runs it (RequestStream's surface)."""

    def __init__(self, cluster: ClusterEngine, request_id: str, prompt: list[int], params: SamplingParams,
                 choices: list[ChoiceStart], cache_key: str | None):
        self.cluster = cluster
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.cache_key = cache_key
        self.bases = {c.index: c.rng_base for c in choices}
        self.tokens: dict[int, list[int]] = {c.index: list(c.token_ids) for c in choices}
        self.open_choices = set(self.bases)
        self.done = False
        self.replica: str | None = None
        self._gen = None
        self._handed: HandedOver | None = None
        self._tried: set[str] = set()
        self._moves = 0
        self._submitted = time.monotonic()
        self._last_token: float | None = None

    # ------------------------------------------------------------ placement
    async def open(self, handed: HandedOver | None = None) -> None:
        """Place the request (its unfinished choices) on a replica and wait for its ack."""
        while True:
            route = self.cluster.router.route(self.prompt, self.cache_key, frozenset(self._tried))
            if route is None:
                raise EngineDead("no replica can take the request")
            name = route.replica
            slot = self.cluster.slots[name]
            choices = [ChoiceStart(i, self.bases[i], tuple(self.tokens[i])) for i in sorted(self.open_choices)]
            handed_choices = None
            if handed is not None:
                handed_choices = [c for c in handed.choices if c.index in self.open_choices]
                for c in handed_choices:  # what the client has is the truth
                    c.token_ids = list(self.tokens[c.index])
            gen = slot.actor.generate.remote(self.request_id, self.prompt, self.params,
                                             None if handed_choices else choices, handed_choices)
            self.cluster.router.placed(name, self.prompt)
            try:
                ack = await (await gen.__anext__())
                assert ack == [], ack
            except Exception as e:
                self.cluster.router.left(name)
                cause = _cause(e)
                if isinstance(cause, (ParamError, ValueError, QueueFull)) and not isinstance(e, _lost_errors()):
                    raise cause from None
                self._tried.add(name)
                if isinstance(e, _lost_errors()):
                    self.cluster.lost(name, type(e).__name__)
                self._moves += 1
                if self._moves > MAX_MOVES:
                    raise EngineDead(f"no replica took the request: {e}") from None
                continue
            self.replica, self._gen = name, gen
            self._tried = set()
            return

    async def _move(self, why: str, handed: HandedOver | None) -> None:
        old, self.replica = self.replica, None
        self.cluster.router.left(old)
        self._moves += 1
        if self._moves > MAX_MOVES:
            raise EngineDead(f"the request was moved {MAX_MOVES} times: {why}")
        if handed is None:
            self.cluster.failovers += 1
        else:
            self.cluster.handovers += 1
            self.cluster.slots[old].handed_over += 1
        self._tried = {old}
        log.info("request %s moves off replica %s (%s)", self.request_id, old, why)
        await self.open(handed)

    # ------------------------------------------------------------ deltas
    def abort(self) -> None:
        if not self.done:
            self.done = True
            if self.replica is not None:
                self.cluster.router.left(self.replica)
                self.cluster.slots[self.replica].actor.abort.remote(self.request_id)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while self.open_choices:
                try:
                    item = await (await self._gen.__anext__())
                except StopAsyncIteration:
                    raise EngineDead(f"replica {self.replica} ended request {self.request_id} early") from None
                except Exception as e:  # the replica is lost (or failed this stream): replay elsewhere
                    if isinstance(e, _lost_errors()):
                        self.cluster.lost(self.replica, type(e).__name__)
                    await self._move(f"{type(e).__name__}: {e}", None)
                    continue
                if isinstance(item, HandedOver):
                    self.cluster.draining(self.replica)
                    await self._move("handed over", item)
                    continue
                for d in item:
                    self._track(d)
                    yield d
            self.done = True
            self.cluster.router.left(self.replica)
            self.replica = None
        finally:
            self.abort()

    def _track(self, d: Delta) -> None:
        obs, now = self.cluster.observer, time.monotonic()
        if d.token_ids:
            self.tokens[d.index].extend(d.token_ids)
            if obs is not None:
                if self._last_token is None:
                    obs.first_token(now - self._submitted)
                else:
                    obs.inter_token(now - self._last_token)
            self._last_token = now
        if d.finish_reason is not None:
            self.open_choices.discard(d.index)
            if obs is not None:
                obs.finished(d, now - self._submitted)
            if d.index == min(self.bases):  # the replica now caches this history too
                self.cluster.router.remember(self.replica, self.prompt + self.tokens[d.index])


def _cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e


def _lost_errors() -> tuple[type, ...]:
    """What Ray raises for a replica that is gone (ActorDiedError is a RayActorError)."""
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)
