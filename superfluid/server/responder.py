"""One response from its choices' streams, whole or streamed (SSE), for every endpoint.

The choices' deltas are merged (choice index = prompt * n + choice) and bounded by the
request's deadline. A whole response gathers them, watching for a client that leaves,
and turns a failed choice into the response's error status; a stream sends each delta
as chunks, a failed choice as an error event (the stream goes on), then the usage when
asked and ``[DONE]``. What differs between endpoints is a ``Shape``: the objects' names,
what is streamed before the first token, a delta's chunks, a whole choice's body.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import AsyncIterator, Iterable, Protocol

from fastapi import Request

from ..engine.serving import DeltaStream
from ..engine.outputs import Delta
from .deadline import with_deadline
from .errors import APIError
from .render import Choice, Usage, error_event, failure, sse

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class Reply:
    """One response: its identity and its prompts' streams, n choices each."""

    rid: str
    created: int
    model: str
    streams: list[DeltaStream]
    n: int
    seconds: float | None  # the deadline; None: none

    @property
    def n_choices(self) -> int:
        return len(self.streams) * self.n

    def head(self, obj: str) -> dict:
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}


class Shape(Protocol):
    """One endpoint's response. An instance serves one response: a stream's per-choice
    state (text offsets, tool-call parsers) lives in it."""

    object: str  # the whole response's "object"
    chunk_object: str  # a streamed chunk's "object"

    def opening(self, n_choices: int) -> Iterable[dict]:
        """The choice entries streamed before any delta."""
        ...

    def visible(self, d: Delta) -> Delta:
        """What of a streamed (not failed) delta the client sees and is billed for."""
        ...

    def entries(self, idx: int, d: Delta) -> Iterable[dict]:
        """A streamed delta's choice entries, one chunk each."""
        ...

    def shown(self, choices: list[Choice], usage: Usage) -> list[Choice]:
        """A whole response's choices as the client sees them (the usage may be rewritten)."""
        ...

    def body(self, c: Choice) -> dict:
        """A whole choice's body."""
        ...


async def merged(streams: list[DeltaStream], n: int) -> AsyncIterator[tuple[int, Delta]]:
    """Deltas of several prompts' streams, as (choice index, delta)."""
    if len(streams) == 1:
        async for d in streams[0]:
            yield d.index, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: DeltaStream) -> None:
        try:
            async for d in s:
                await queue.put((i * n + d.index, d))
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            item = await queue.get()
            if item is None:
                live -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


# ------------------------------------------------------------------ whole


async def whole(request: Request, reply: Reply, shape: Shape) -> dict:
    choices, usage = await collect(request, reply)
    choices = shape.shown(choices, usage)
    return dict(reply.head(shape.object), choices=[shape.body(c) for c in choices], usage=usage.body())


async def collect(request: Request, reply: Reply) -> tuple[list[Choice], Usage]:
    """Every choice's deltas gathered; APIError for a client that left or a failed choice."""
    choices = [Choice(i) for i in range(reply.n_choices)]
    usage = Usage()

    async def run() -> None:
        async for idx, d in with_deadline(merged, reply.seconds)(reply.streams, reply.n):
            choices[idx].add(d)
            if d.finish_reason is not None:
                usage.add_final(d)

    task = asyncio.create_task(run())
    while not task.done():
        await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            for s in reply.streams:
                s.abort()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise APIError(499, "the client disconnected", None, "client_disconnected")
    task.result()
    for c in choices:
        _raise_failed(c)
    return choices, usage


def _raise_failed(c: Choice) -> None:
    """A failed choice fails the whole response, with the status its code maps to."""
    if c.finish_reason != "error":
        return
    e = failure(c.error_code)
    raise APIError(e.status, c.error or e.message, e.param, e.code)


# ------------------------------------------------------------------ streamed


@dataclass
class RunningUsage:
    """vLLM's continuous_usage_stats: the usage so far, on every chunk. As vLLM's, a chunk
    counts its own choice's tokens (with n > 1 each choice's chunks count that choice):
    its visible tokens as they stream, then its final count (a stop string may cut it)."""

    prompt_tokens: int
    so_far: dict[int, int]

    def add(self, idx: int, d: Delta) -> None:
        done = d.finish_reason is not None
        self.so_far[idx] = d.completion_tokens if done else self.so_far.get(idx, 0) + len(d.token_ids)

    def body(self, idx: int) -> dict:
        n = self.so_far.get(idx, 0)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


async def events(reply: Reply, shape: Shape, include_usage: bool,
                 running: RunningUsage | None = None) -> AsyncIterator[str]:
    """The SSE events of one response (stream_hub.py records and serves them); closing it
    (no client came back) aborts the streams. ``running``: every chunk carries the usage so far."""
    usage = Usage()
    head = reply.head(shape.chunk_object)

    def chunk(entry: dict) -> str:
        c = dict(head, choices=[entry])
        if include_usage:  # every chunk names usage (null unless continuous) when the last one carries it
            c["usage"] = running.body(entry["index"]) if running is not None else None
        return sse(c)

    for entry in shape.opening(reply.n_choices):
        yield chunk(entry)
    async for idx, d in with_deadline(merged, reply.seconds)(reply.streams, reply.n):
        if d.finish_reason == "error":
            yield error_event(d)
            continue
        d = shape.visible(d)
        if running is not None:
            running.add(idx, d)
        for entry in shape.entries(idx, d):
            yield chunk(entry)
        if d.finish_reason is not None:
            usage.add_final(d)
    if include_usage:
        yield sse(dict(head, choices=[], usage=usage.body()))
    yield sse("[DONE]")
