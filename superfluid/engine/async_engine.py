"""The engine behind the server: a background thread runs ticks; asyncio awaits them.
It is a ``ServingEngine`` (serving.py): the server sees the model and the scheduler's
figures through it, never the ``Engine`` inside.

Invariants:
- Only the loop thread touches the engine (and so the executor). Other threads talk
  to it through ``_inbox`` (adds, aborts) and the rings' yield flag, which they
  raise so that a running tick ends at its next step boundary and the new request
  is admitted without waiting out a long tick.
- A request's deltas reach its asyncio queue in the order they were produced
  (``call_soon_threadsafe`` is FIFO per loop).
- A consumer that goes away (client disconnect, cancelled task) aborts its request;
  the lane retires at the next tick.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from ..executor.interface import ExecutorLost
from .engine import Engine
from .outputs import Delta, ErrorCode
from .params import SamplingParams
from .request import ChoiceStart
from .serving import EngineDead, Figures, Observer, QueueFull

log = logging.getLogger("superfluid.engine")
MAX_BACKLOG = 8192  # deltas a consumer may leave unread before its request is aborted


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    admitted: asyncio.Future
    n: int
    submitted: float = field(default_factory=time.monotonic)
    finished: int = 0
    last_token: float | None = None
    backlogged: bool = False  # its consumer fell MAX_BACKLOG deltas behind: aborted


class AsyncEngine:
    def __init__(self, engine: Engine, max_queued: int = 256, observer: Observer | None = None):
        self.engine = engine
        self.max_queued = max_queued
        self.observer = observer
        self._inbox: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}  # loop thread only
        self._compiling: dict[str, _Stream] = {}  # queued, their grammar compiling; not yet settled
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._drain_deadline: float | None = None  # set by begin_drain (SIGTERM)
        self.error: BaseException | None = None
        engine.stream_to(self._deliver)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="superfluid-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0, drain: float = 0.0) -> None:
        """Stop the loop. With ``drain`` seconds, first stop admitting (DRAIN) and let
        running requests finish for up to that long; whatever is left is aborted."""
        if drain > 0 and self.alive:
            self.engine.scheduler.draining = True  # read by the loop thread at its next plan
            deadline = time.monotonic() + drain
            while self.engine.scheduler.num_running and time.monotonic() < deadline:
                time.sleep(0.05)
        self._stopping = True
        self._wake.set()
        self.engine.rings.request_yield(True)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self.engine.close()

    def begin_drain(self, seconds: float) -> None:
        """Stop admitting now; requests still running ``seconds`` later end with an
        error, and so do waiting ones at once (a draining engine admits none). Only
        sets a field, so a signal handler may call it; the loop acts within 0.1 s or
        at its next tick."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + seconds

    def _check_drain(self) -> None:
        deadline = self._drain_deadline
        if deadline is None:
            return
        self.engine.scheduler.draining = True
        expired = time.monotonic() >= deadline
        for rid in list(self._streams):
            if expired or not self.engine.is_running(rid):
                self.engine.fail(rid, "the server is shutting down", ErrorCode.SHUTTING_DOWN)

    @property
    def pid(self) -> int | None:
        """The process that runs the model (a worker's, or this one; None while a
        lost worker is being replaced)."""
        return self.engine.model_pid

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_queued(self) -> int:
        """Requests not yet running: in the inbox or the scheduler's queue."""
        adds = sum(1 for item in list(self._inbox) if item[0] == "add")
        return adds + self.engine.scheduler.num_waiting

    # ------------------------------------------------------------ the model served
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def desc(self):
        return self.engine.desc

    @property
    def config(self):
        return self.engine.config

    @property
    def max_seq_len(self) -> int:
        return self.engine.max_seq_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def figures(self) -> Figures:
        """The scheduler's queue, lanes and stats (plain reads, safe from any thread)."""
        return self.engine.scheduler

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    def worker_health(self) -> dict | None:
        return self.engine.worker_health()

    # ------------------------------------------------------------ requests
    async def submit(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        choices: list[ChoiceStart] | None = None, cache_key: str | None = None,
    ) -> "RequestStream":
        """Queue a request and wait until the engine took it. Raises ParamError (bad
        input, e.g. an invalid grammar), QueueFull or EngineDead. ``choices``: see
        ``Engine.add_request``; ``cache_key`` (OpenAI's ``prompt_cache_key``) is a
        routing hint for a front door over several replicas; one engine has one cache."""
        if not self.alive:
            raise EngineDead("the engine is not running")
        if self.num_queued >= self.max_queued:
            raise QueueFull(f"{self.num_queued} requests are waiting (--max-queued-requests {self.max_queued})")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future(), params.n if choices is None else len(choices))
        self._inbox.append(("add", request_id, prompt_token_ids, params, stream, choices))
        self._wake.set()
        self.engine.rings.request_yield(True)
        try:
            await stream.admitted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> AsyncIterator[Delta]:
        """Deltas of every choice of one request, until all finished."""
        rs = await self.submit(request_id, prompt_token_ids, params)
        async for delta in rs:
            yield delta

    def abort(self, request_id: str) -> None:
        self._inbox.append(("abort", request_id))
        self._wake.set()

    # ------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self.engine.rings.request_yield(False)
                self._drain_inbox()
                self._settle_compiled()
                self._check_drain()
                if not self.engine.has_work():
                    self.engine.check_worker()
                    self._wake.wait(0.1)
                    continue
                if self._compiling and not self.engine.scheduler.num_running:
                    self._wake.wait(0.005)  # only compiles to wait for: do not spin
                try:
                    self.engine.step()
                except Exception as e:  # the engine failed every request it held
                    log.exception("engine step failed: %s", e)
        except BaseException as e:
            self.error = e
            log.exception("the engine loop died")
        finally:
            for rid in list(self._streams) + list(self._compiling):
                self.engine.abort(rid)
            for stream in self._compiling.values():
                _settle(stream, error=EngineDead("the engine stopped"))
            self._fail_inbox(EngineDead("the engine stopped"))

    def _drain_inbox(self) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "abort":
                if item[1] in self._streams or item[1] in self._compiling:
                    self.engine.abort(item[1])
                    self._streams.pop(item[1], None)
                    self._compiling.pop(item[1], None)
                continue
            _, rid, ids, params, stream, choices = item
            try:
                # A grammar compiles in the worker's pool, not on this loop: the request
                # is settled (accepted, or its 400) once the compile ends.
                try:
                    self.engine.add_request(rid, ids, params, choices, wait_grammar=False)
                except ExecutorLost as e:
                    self.engine.recover_or_fail(e)  # then once more, on the clean worker
                    self.engine.add_request(rid, ids, params, choices, wait_grammar=False)
            except Exception as e:
                _settle(stream, error=e)
                continue
            if self.engine.grammar_pending(rid):
                self._compiling[rid] = stream
                continue
            self._streams[rid] = stream
            _settle(stream)

    def _settle_compiled(self) -> None:
        # Every turn, not only while a submission waits: a replaced worker compiles the
        # grammars of requests already running again (handles renewed), in the background.
        # (The engine tracks which requests compile, so a turn with none costs nothing.)
        for rid, error in self.engine.poll_grammars():
            stream = self._compiling.pop(rid, None)
            if stream is None:
                continue
            if error is not None:
                _settle(stream, error=error)
            else:
                self._streams[rid] = stream
                _settle(stream)

    def _fail_inbox(self, error: Exception) -> None:
        while self._inbox:
            item = self._inbox.popleft()
            if item[0] == "add":
                _settle(item[4], error=error)

    def _deliver(self, delta: Delta) -> None:
        stream = self._streams.get(delta.request_id)
        if stream is None:
            return
        now = time.monotonic()
        if delta.token_ids and self.observer is not None:
            if stream.last_token is None:
                self.observer.first_token(now - stream.submitted)
            else:
                self.observer.inter_token(now - stream.last_token)
        if delta.token_ids:
            stream.last_token = now
        if delta.finish_reason is not None:
            stream.finished += 1
            if self.observer is not None:
                self.observer.finished(delta, now - stream.submitted)
            if stream.finished >= stream.n:
                self._streams.pop(delta.request_id, None)
        if not stream.backlogged and stream.queue.qsize() >= MAX_BACKLOG:
            # A consumer that stopped reading: its queue is bounded by aborting it (at the
            # loop's next turn, outside the tick that produced this delta).
            stream.backlogged = True
            log.warning("request %s: %d deltas unread; aborting it", delta.request_id, MAX_BACKLOG)
            self.abort(delta.request_id)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            self._streams.pop(delta.request_id, None)


def _settle(stream: _Stream, error: Exception | None = None) -> None:
    def settle() -> None:
        if stream.admitted.done():
            return
        if error is None:
            stream.admitted.set_result(None)
        else:
            stream.admitted.set_exception(error)

    try:
        stream.loop.call_soon_threadsafe(settle)
    except RuntimeError:
        pass


class RequestStream:
    """The deltas of one admitted request. Leaving the iteration early (a client
    that went away, a cancelled task) aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str, stream: _Stream):
        self.engine = engine
        self.request_id = request_id
        self._stream = stream
        self.done = False

    def abort(self) -> None:
        if not self.done:
            self.done = True
            self.engine.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[Delta]:
        finished = 0
        try:
            while finished < self._stream.n:
                delta: Delta = await self._stream.queue.get()
                if delta.finish_reason is not None:
                    finished += 1
                yield delta
            self.done = True
        finally:
            self.abort()
