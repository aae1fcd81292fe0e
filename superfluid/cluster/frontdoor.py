"""The front door: one AsyncEngine-shaped engine over the replicas.

``create_app`` serves from it unchanged: ``submit`` routes (``Router``), opens the
chosen replica's Ray generator and waits for its admission ack; the stream then
yields the replica's deltas. The stream keeps, per choice, the tokens it has passed
on and the choice's rng base (chosen here, so it survives any replica), and that is
all it needs to move the request:

- the replica dies (actor killed, node lost; any Ray error mid-stream): the request is
  re-admitted on another replica with those tokens decode-replayed and the same rng
  base, so the text continues exactly where the client's stream is;
- the replica drains (scale-down, SIGTERM): its generator ends with ``HandedOver``,
  the KV exported; the next replica adopts it and continues from it.

Invariants: every delta a client sees was produced once (a replayed token is never
sent again: a new replica's engine re-processes them silently); a request is placed
on exactly one replica at a time, which the router's load counts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..engine.async_engine import EngineDead, QueueFull
from ..engine.engine import Engine
from ..engine.outputs import Delta
from ..engine.params import ParamError, SamplingParams
from ..engine.request import ChoiceStart, rng_base
from .handover import HandedOver
from .router import Router

log = logging.getLogger("superfluid.cluster")

MAX_MOVES = 8  # replicas one request may be moved over before it fails
HEALTH_EVERY_S = 1.0


@dataclass
class ReplicaSlot:
    name: str
    actor: Any
    info: dict = field(default_factory=dict)
    state: str = "up"  # up, down (lost; Ray restarts it), draining, removed
    health: dict = field(default_factory=dict)
    losses: int = 0
    handed_over: int = 0


class ClusterCore:
    """What the OpenAI app reads from ``engine.engine``: tokenizer, limits, health."""

    validate = Engine.validate  # the same checks a replica's engine makes, made at the door

    def __init__(self, cluster: "ClusterEngine", tokenizer, desc, config, model_name: str):
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.desc = desc
        self.config = config
        self.model_name = model_name
        self.scheduler = None

    @property
    def vocab_size(self) -> int:
        return self.desc.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.desc.max_seq_len

    def worker_health(self) -> dict:
        return self.cluster.health()


class ClusterEngine:
    def __init__(self, slots: list[ReplicaSlot], router: Router, max_queued: int = 256):
        self.slots = {s.name: s for s in slots}
        self.router = router
        self.max_queued = max_queued
        self.engine: ClusterCore | None = None  # set by launch
        self.observer = None
        self.failovers = 0  # requests moved off a lost replica
        self.handovers = 0  # requests moved off a draining replica by export/adopt
        self._pending = 0  # submitted, not yet admitted by a replica
        self._started = False
        self._stopped = False
        self._drain_deadline: float | None = None
        self._tasks: set[asyncio.Task] = set()
        for s in slots:
            router.add(s.name)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "ClusterEngine":
        self._started = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return self
        if not self._tasks:
            self._spawn(self._watch_health(), loop)
        return self

    def _spawn(self, coro, loop=None) -> None:
        task = (loop or asyncio.get_running_loop()).create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stop(self, timeout: float = 5.0, drain: float = 0.0) -> None:
        import ray

        self._stopped = True
        for t in list(self._tasks):
            t.cancel()
        for s in self.slots.values():
            try:
                ray.get(s.actor.stop.remote(), timeout=timeout)
            except Exception:
                pass
            ray.kill(s.actor, no_restart=True)

    def begin_drain(self, seconds: float) -> None:
        self._drain_deadline = time.monotonic() + seconds

    @property
    def alive(self) -> bool:
        return self._started and not self._stopped and any(s.state == "up" for s in self.slots.values())

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def num_queued(self) -> int:
        return self._pending

    # ------------------------------------------------------------ requests
    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     choices: list[ChoiceStart] | None = None, cache_key: str | None = None) -> "ClusterStream":
        if not self.alive or self._drain_deadline is not None:
            raise EngineDead("no replica is serving" if not self.alive else "the server is shutting down")
        if self._pending >= self.max_queued:
            raise QueueFull(f"{self._pending} requests are waiting (--max-queued-requests {self.max_queued})")
        if choices is None:  # the rng bases are chosen here, so that they survive any replica
            choices = [ChoiceStart(i, rng_base(params.seed, i)) for i in range(params.n)]
        stream = ClusterStream(self, request_id, list(prompt_token_ids), params, choices, cache_key)
        self._pending += 1
        try:
            await stream.open()
        finally:
            self._pending -= 1
        return stream

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       cache_key: str | None = None) -> AsyncIterator[Delta]:
        rs = await self.submit(request_id, prompt_token_ids, params, cache_key=cache_key)
        async for d in rs:
            yield d

    # ------------------------------------------------------------ replicas
    def lost(self, name: str, why: str) -> None:
        s = self.slots.get(name)
        if s is None or s.state in ("removed",):
            return
        if s.state == "up":
            log.warning("replica %s was lost (%s); its requests move to other replicas", name, why)
            s.losses += 1
        if s.state != "draining":
            s.state = "down"
        self.router.set_up(name, False)

    def draining(self, name: str) -> None:
        s = self.slots.get(name)
        if s is not None and s.state == "up":
            s.state = "draining"
            self.router.set_up(name, False)

    async def drain_replica(self, name: str) -> int:
        """Scale-down: the replica hands its requests over (export/adopt), then leaves."""
        import ray

        s = self.slots[name]
        self.draining(name)
        rids = await s.actor.hand_over.remote()
        await asyncio.sleep(0.5)  # the handed-over streams' last items arrive
        s.state = "removed"
        try:
            await asyncio.wait_for(s.actor.stop.remote(), 10)
        except Exception:
            pass
        ray.kill(s.actor, no_restart=True)
        return len(rids)

    async def _watch_health(self) -> None:
        while not self._stopped:
            await asyncio.gather(*(self._probe(s) for s in self.slots.values() if s.state != "removed"))
            await asyncio.sleep(HEALTH_EVERY_S)

    async def _probe(self, s: ReplicaSlot) -> None:
        try:
            h = await asyncio.wait_for(s.actor.health.remote(), 5.0)
        except Exception as e:
            self.lost(s.name, f"health: {type(e).__name__}")
            s.health = {"name": s.name}
            return
        s.health = h
        if h.get("draining"):
            self.draining(s.name)
        elif s.state == "down" and h.get("alive"):  # Ray restarted it: a clean replica
            s.state = "up"
            self.router.set_up(s.name, True)

    def health(self) -> dict:
        """The fields /health reads (as a single engine's worker), and every replica."""
        replicas = []
        for s in self.slots.values():
            h = s.health
            replicas.append({"name": s.name, "state": s.state, "load": self.router.load[s.name],
                             "pid": h.get("pid", s.info.get("pid")), "node": s.info.get("node"),
                             "running": h.get("running"), "waiting": h.get("waiting"),
                             "worker": h.get("worker"), "losses": s.losses,
                             "routed": dict(self.router.routed.get(s.name, {}))})
        states = [s.state for s in self.slots.values() if s.state != "removed"]
        state = "ok" if states and all(x == "up" for x in states) else ("failed" if "up" not in states else "degraded")
        return {"state": state, "restarts": sum(s.losses for s in self.slots.values()), "last_exit": None,
                "replicas": replicas}


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
        import ray

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
