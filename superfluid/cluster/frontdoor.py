"""The front door: one ``ServingEngine`` (engine/serving.py) over the replicas.

``create_app`` serves from it as from one engine: ``submit`` chooses each choice's rng base
(here, so that it survives any replica), routes (``Router``), opens the chosen
replica's Ray generator and waits for its admission ack; the ``ClusterStream`` then
yields the replica's deltas and moves the request when its replica dies or drains.
Replica states: up; down (lost: Ray restarts it, a health probe takes it back);
draining (takes no new request); removed (scaled down).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from ..engine.engine import Engine
from ..engine.outputs import Delta
from ..engine.params import SamplingParams
from ..engine.request import ChoiceStart, rng_base
from ..engine.serving import EngineDead, Observer, QueueFull
from .router import Router
from .stream import ClusterStream

log = logging.getLogger("superfluid.cluster")

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


class ClusterEngine:
    """The replicas as one engine. The model facts (tokenizer, desc, config, name) are the
    replicas' own, so the door checks and tokenizes a request as any replica would."""

    validate = Engine.validate  # the same checks a replica's engine makes, made at the door
    figures = None  # no scheduler here: cluster_metrics reports each replica's figures

    def __init__(self, slots: list[ReplicaSlot], router: Router, *, tokenizer, desc, config, model_name: str,
                 max_queued: int = 256):
        self.slots = {s.name: s for s in slots}
        self.router = router
        self.tokenizer = tokenizer
        self.desc = desc
        self.config = config
        self.model_name = model_name
        self.max_queued = max_queued
        self.observer: Observer | None = None
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

        if self._stopped or not ray.is_initialized():
            # once only, and never after ray.shutdown(): ray.kill on a handle of a finished
            # session would start a new Ray instance (its auto-init) just to fail
            self._stopped = True
            return
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

    @property
    def vocab_size(self) -> int:
        return self.desc.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.desc.max_seq_len

    def worker_health(self) -> dict:
        return self.health()

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
