"""One streamed response, recorded: the SSE events it sent, for every reader it has.

A stream's events are produced once, by a pump task that reads the response's own event
generator (responder.py, responses/events.py) and appends each event here; every HTTP
reader -- the first client, and any client that reconnects -- reads from this log. So a
reader that resumes after event N gets the very bytes the first reader got from N + 1 on,
whether the generation went on meanwhile or its worker crashed and was replayed below
(the engine's replay hands the pump the same deltas).

Invariants:
- Event ``n`` (0-based) of stream ``sid`` is ``id: sid:n`` followed by the generator's own
  lines; ids are never reused and an event is never changed once appended.
- ``first`` is the index of ``events[0]``: a log may lose its oldest events under the
  hub's byte cap (stream_hub.py); a reader that needs one of those is refused, never served
  a stream with a hole.
- Only the event loop thread touches a log (no locks); waiting readers are woken by
  replacing ``_more``, a future set on every append and at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field


@dataclass(frozen=True)
class StreamConfig:
    """The stream hub's bounds (stream_hub.py); here, so that the CLI reads them without FastAPI."""

    retention_s: float = 300.0  # a finished stream stays resumable this long
    grace_s: float = 5.0  # a stream that may not run on alone waits this long for a reader to come back
    max_streams: int = 1024  # finished streams kept
    max_bytes: int = 64 << 20  # event bytes kept over every stream


class StreamGone(Exception):
    """The events a reader asked for are no longer retained."""


def event_id(sid: str, n: int) -> str:
    return f"{sid}:{n}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``sid:n`` -> (sid, n); None when it is not one of ours."""
    sid, sep, n = value.strip().rpartition(":")
    if not sep or not sid or not n.isdigit():
        return None
    return sid, int(n)


@dataclass
class StreamLog:
    sid: str
    path: str  # the endpoint that made it: a resumption must come to the same one
    keep_running: bool  # True: the generation runs to its end with no reader (else: a grace window)
    events: list[str] = field(default_factory=list)
    first: int = 0
    nbytes: int = 0
    done: bool = False
    ended_at: float | None = None  # time.monotonic() at the end
    created: float = field(default_factory=time.monotonic)
    readers: dict[int, int] = field(default_factory=dict)  # reader -> the next event index it reads
    pump: asyncio.Task | None = None
    _more: asyncio.Future | None = None
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def next_index(self) -> int:
        return self.first + len(self.events)

    def append(self, text: str) -> int:
        """Record one event (the generator's text); returns its size in bytes."""
        ev = f"id: {event_id(self.sid, self.next_index)}\n{text}"
        self.events.append(ev)
        size = len(ev.encode())
        self.nbytes += size
        self._wake()
        return size

    def finish(self) -> None:
        if not self.done:
            self.done = True
            self.ended_at = time.monotonic()
            self._wake()

    def trim(self, upto: int) -> int:
        """Drop the events before index ``upto``; returns the bytes freed."""
        k = max(0, min(upto, self.next_index) - self.first)
        freed = sum(len(e.encode()) for e in self.events[:k])
        del self.events[:k]
        self.first += k
        self.nbytes -= freed
        return freed

    def needed_from(self) -> int:
        """The oldest event an attached reader still has to read (the end when none is attached)."""
        return min(self.readers.values(), default=self.next_index)

    def _wake(self) -> None:
        if self._more is not None and not self._more.done():
            self._more.set_result(None)
        self._more = None

    async def read(self, start: int):
        """The events from index ``start`` on, waiting for new ones until the stream ends.
        Raises StreamGone when ``start`` was trimmed away."""
        if start < self.first:
            raise StreamGone(f"the events of stream {self.sid} before {self.first} are no longer retained")
        reader = next(self._ids)
        self.readers[reader] = start
        try:
            while True:
                while self.readers[reader] < self.next_index:
                    i = self.readers[reader]
                    if i < self.first:  # trimmed under this reader: end rather than skip events
                        return
                    self.readers[reader] = i + 1
                    yield self.events[i - self.first]
                if self.done:
                    return
                if self._more is None:
                    self._more = asyncio.get_running_loop().create_future()
                await asyncio.shield(self._more)
        finally:
            del self.readers[reader]
