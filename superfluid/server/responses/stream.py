"""A response's SSE events, and its whole form, from the engine's deltas.

Both end the same way: the response is built (build.py), then stored (``Turn.end``), and
only then is its final event sent or its object answered, so that a client that reads
``response.completed`` and sends the next turn at once finds this one stored.

SSE framing is OpenAI's: ``event: <type>`` then ``data: <json>``; no ``[DONE]``. The
stream hub adds each event's ``id:`` (stream_hub.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from fastapi import Request

from ..deadline import with_deadline
from ..render import Usage
from ..responder import Reply, collect, merged
from .build import ResponseBuild


@dataclass
class Turn:
    """One response in flight: what it is built into and what is stored at its end."""

    build: ResponseBuild
    reply: Reply
    prompt_ids: list[int]
    history: list[dict]  # the conversation's items before this response's output
    end: Callable[["Turn", bool], Awaitable[None]]  # (turn, done): store it if done and asked, forget it as live
    output_ids: list[int] = field(default_factory=list)


def sse(event: dict) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


async def events(turn: Turn) -> AsyncIterator[str]:
    b, usage, last = turn.build, Usage(), None
    try:
        for e in b.opening():
            yield sse(e)
        async for _, d in with_deadline(merged, turn.reply.seconds)(turn.reply.streams, turn.reply.n):
            turn.output_ids += d.token_ids
            for e in b.push(d.text):
                yield sse(e)
            if d.finish_reason is not None:
                usage.add_final(d)
                last = d
        closing = b.finish(last and last.finish_reason, last and last.error, usage, last and last.error_code)
        await turn.end(turn, True)
        for e in closing:
            yield sse(e)
    finally:
        if b.status == "in_progress":  # cancelled (no reader came back, the server stops): nothing to store
            await turn.end(turn, False)


async def whole(request: Request, turn: Turn) -> dict:
    """The response object once it is done; APIError for a failure or a client that left."""
    try:
        choices, usage = await collect(request, turn.reply)
    except BaseException:
        await turn.end(turn, False)
        raise
    c = choices[0]
    turn.output_ids = list(c.token_ids)
    turn.build.push(c.text)
    turn.build.finish(c.finish_reason, c.error, usage, c.error_code)
    await turn.end(turn, True)
    return turn.build.snapshot()
