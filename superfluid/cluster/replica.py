"""One replica: a Ray actor that owns an engine (its supervised worker and runtime).

``ReplicaEngine`` is the AsyncEngine with two more things a replica needs: ``call``
runs a function on the loop thread between ticks (the engine is single-threaded), and
``hand_over`` detaches every request, exports its KV and ends its stream with a
``HANDOVER`` finish on each unfinished choice; the stream's generator then yields the
``HandedOver`` record as its last item, and the front door continues the request on
another replica.

The actor streams each request's deltas as a Ray generator (lists of deltas: what
arrived since the last yield). It is an async actor: the engine's loop thread hands
deltas to the actor's event loop, which Ray serves requests on.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import logging
import os
from typing import Any, AsyncIterator, Callable

from ..engine.async_engine import AsyncEngine
from ..engine.config import EngineConfig
from ..engine.outputs import Delta
from ..engine.params import SamplingParams
from ..engine.request import ChoiceStart
from .handover import HandedChoice, HandedOver, adopt_choices, hand_over

log = logging.getLogger("superfluid.cluster")

HANDOVER = "handover"  # the finish reason of a choice whose request moved to another replica


class ReplicaEngine(AsyncEngine):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._calls: collections.deque = collections.deque()
        self.handed: dict[str, HandedOver] = {}  # request id -> its state, until its stream ends
        self.draining = False

    async def call(self, fn: Callable[["ReplicaEngine"], Any]) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._calls.append((fn, loop, fut))
        self._wake.set()
        self.engine.rings.request_yield(True)
        return await fut

    def _check_drain(self) -> None:  # the loop thread, between ticks
        super()._check_drain()
        while self._calls:
            fn, loop, fut = self._calls.popleft()
            try:
                result, error = fn(self), None
            except Exception as e:
                result, error = None, e
            loop.call_soon_threadsafe(_settle_future, fut, result, error)

    async def hand_over(self) -> list[str]:
        """Stop admitting and hand every request over; returns their ids."""
        self.draining = True

        def run(me: "ReplicaEngine") -> list[str]:
            rids = list(me._streams)
            handed = hand_over(me.engine, rids)
            for rid, h in handed.items():
                me.handed[rid] = h
                stream = me._streams.pop(rid, None)
                if stream is None:
                    continue
                for c in h.choices:
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, Delta(rid, c.index, finish_reason=HANDOVER))
            return rids

        return await self.call(run)


def _settle_future(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _on_sigterm(hand_over: Callable[[], None]) -> bool:
    """Hand the running requests over as soon as SIGTERM arrives.

    Ray's SIGTERM handler runs on the main thread (which Ray holds: an actor cannot set
    its own handler) and raises SystemExit through ``ray._private.worker.
    raise_sys_exit_with_custom_error_message``; the graceful exit then waits for the
    running tasks -- our streams -- to finish, however long they are, and a grace
    period that runs out first kills them (recomputed elsewhere, not moved). Wrapping
    that one function (ray is pinned; tests/test_cluster.py's SIGTERM test fails if it
    stops being called) hands every request over first, so each stream ends at once
    with its HandedOver and the exit is prompt. False: this Ray has no such hook.
    """
    import ray._private.worker as ray_worker

    exit_with = getattr(ray_worker, "raise_sys_exit_with_custom_error_message", None)
    if exit_with is None or getattr(exit_with, "superfluid_wrapped", False):
        return False

    def handing_over_first(message: str, exit_code: int = 0) -> None:
        if "SIGTERM" in message:
            hand_over()
        exit_with(message, exit_code)

    handing_over_first.superfluid_wrapped = True  # type: ignore[attr-defined]
    ray_worker.raise_sys_exit_with_custom_error_message = handing_over_first
    return True


class ReplicaActor:
    """Wrapped with ``ray.remote`` by ``launch`` (so that importing this needs no Ray)."""

    def __init__(self, name: str, config: EngineConfig):
        from ..engine.loader import build_engine

        self.name = name
        self.engine = ReplicaEngine(build_engine(config), max_queued=config.max_queued_requests)
        self.engine.start()
        self._loop: asyncio.AbstractEventLoop | None = None
        # SIGTERM (a node drained, a pod stopped): see _on_sigterm. The atexit hook covers
        # any other exit of the process that runs them.
        _on_sigterm(self._hand_over_at_exit)
        atexit.register(self._hand_over_at_exit)

    def _hand_over_at_exit(self, timeout: float = 10.0) -> None:
        loop = self._loop
        if loop is None or not loop.is_running() or not self.engine.alive:
            return

        async def run() -> None:
            if await self.engine.hand_over():
                await asyncio.sleep(1.0)  # the streams' last items reach the front door

        try:
            asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)
        except Exception as e:
            log.warning("replica %s could not hand its requests over at exit: %s", self.name, e)

    async def ready(self) -> dict:
        self._loop = asyncio.get_running_loop()
        import ray

        desc = self.engine.desc
        return {"name": self.name, "pid": os.getpid(), "model_pid": self.engine.pid,
                "node": ray.get_runtime_context().get_node_id(), "page": desc.page,
                "model": self.engine.model_name, "desc": desc}

    async def generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                       choices: list[ChoiceStart] | None = None,
                       handed: list[HandedChoice] | None = None) -> AsyncIterator[Any]:
        """Lists of deltas as they come; a request handed over ends with its HandedOver.
        ``handed``: the request comes from a draining replica with exported KV."""
        self._loop = asyncio.get_running_loop()  # a restarted actor is not asked ready() again
        if self.engine.draining:
            raise RuntimeError(f"replica {self.name} is draining")
        if handed is not None:
            choices = await self.engine.call(lambda me: adopt_choices(me.engine, handed, prompt))
        rs = await self.engine.submit(request_id, prompt, params, choices=choices)
        yield []  # the ack: admitted (a bad request raised above, before any text)
        queue = rs._stream.queue  # the deltas in order; batching them saves Ray round trips
        left = rs._stream.n
        try:
            while left:
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                left -= sum(1 for d in batch if d.finish_reason is not None)
                out = [d for d in batch if d.finish_reason != HANDOVER]
                if out:
                    yield out
            rs.done = True
            h = self.engine.handed.pop(request_id, None)
            if h is not None:
                yield h
        finally:
            rs.abort()

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    async def hand_over(self) -> list[str]:
        return await self.engine.hand_over()

    async def health(self) -> dict:
        worker = self.engine.worker_health() or {}
        s = self.engine.figures
        return {"name": self.name, "alive": self.engine.alive, "draining": self.engine.draining,
                "pid": os.getpid(), "model_pid": self.engine.pid, "running": s.num_running,
                "waiting": s.num_waiting, "kv_usage": s.stats.kv_usage,
                "prefix_hit_tokens": s.stats.prefix_hit_tokens, "worker": worker.get("state", "in-process"),
                "restarts": worker.get("restarts", 0)}

    async def stop(self) -> None:
        self.engine.stop(timeout=5.0)  # (nothing left to hand over at exit)
