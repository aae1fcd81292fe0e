"""A request's wall-clock deadline: the ``timeout`` request field (seconds; an extension)
or the server's ``--request-timeout``, whichever is sooner. Past it the request's lanes
are aborted (retired at the next tick) and the client gets an error: a 503 body for a
whole response, an error event then ``[DONE]`` for a stream."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from ..engine.outputs import Delta, ErrorCode

DEADLINE_CODE = ErrorCode.DEADLINE.value


def deadline_s(requested: float | None, server_cap: float) -> float | None:
    """The seconds a request may take (None: no deadline)."""
    limits = [t for t in (requested, server_cap) if t]
    return min(limits) if limits else None


def message(seconds: float) -> str:
    return f"the request did not finish within its deadline of {seconds:g} s"


def with_deadline(merged: Callable, seconds: float | None) -> Callable:
    """``merged`` (streams -> (choice index, delta) pairs), ending with an error delta for
    every unfinished choice once ``seconds`` have passed."""
    if seconds is None:
        return merged

    async def bounded(streams, n) -> AsyncIterator[tuple[int, Delta]]:
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        it = merged(streams, n).__aiter__()
        open_choices = set(range(len(streams) * n))
        try:
            while True:
                left = end - loop.time()
                if left <= 0:
                    raise asyncio.TimeoutError
                idx, d = await asyncio.wait_for(it.__anext__(), left)
                if d.finish_reason is not None:
                    open_choices.discard(idx)
                yield idx, d
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            for s in streams:
                s.abort()
            for idx in sorted(open_choices):
                yield idx, Delta(request_id="", index=idx, finish_reason="error", error=message(seconds),
                                 error_code=ErrorCode.DEADLINE)
        finally:
            await it.aclose()

    return bounded
