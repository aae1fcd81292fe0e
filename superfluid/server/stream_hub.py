"""Resumable streams: every streamed response is recorded (stream_log.py) and served from
its record, so that a client whose connection dropped can reconnect with ``Last-Event-ID``
and read the rest, byte for byte.

What a disconnect does (the readers of a stream all gone before its end):
- a ``keep_running`` stream (a Responses stream with ``store: true``) runs on to its end
  with no reader, as OpenAI's background responses do; it is stored and stays resumable;
- any other stream (chat, completions, responses with ``store: false``) keeps running for
  ``grace_s`` seconds; a reader that comes back within them continues it, else the stream
  is cancelled, which aborts its requests as a disconnect did before (``grace_s`` 0: at once).

Bounds: a finished stream stays resumable for ``retention_s`` seconds; at most
``max_streams`` finished streams and ``max_bytes`` of events over all streams are kept,
the oldest finished streams dropped first; past that, the live stream holding the most
bytes loses its oldest events that no attached reader still needs (a resumption from
before them is refused with 410, never answered with a hole).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse  # the type callers see

from .errors import APIError
from .idle_stream import IdleBoundedStream
from .stream_log import StreamConfig, StreamLog, parse_event_id

log = logging.getLogger("superfluid.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class StreamHub:
    def __init__(self, config: StreamConfig = StreamConfig(), idle_s: float = 60.0):
        self.config = config
        self.idle_s = idle_s  # a reader that takes nothing this long is cut off (idle_stream.py)
        self.logs: dict[str, StreamLog] = {}  # insertion order: oldest first
        self.nbytes = 0
        self._grace: dict[str, asyncio.TimerHandle] = {}

    # ------------------------------------------------------------ recording
    def record(self, sid: str, path: str, source: AsyncIterator[str], keep_running: bool) -> StreamingResponse:
        """Start recording ``source`` (one response's SSE events); the response reads it from the start."""
        return self.response(self.start(sid, path, source, keep_running), 0)

    def start(self, sid: str, path: str, source: AsyncIterator[str], keep_running: bool) -> StreamLog:
        """Pump ``source`` into a new log, with or without a reader (a background response)."""
        self.sweep()
        s = StreamLog(sid, path, keep_running)
        self.logs[sid] = s
        s.pump = asyncio.get_running_loop().create_task(self._pump(s, source), name=f"stream {sid}")
        return s

    async def _pump(self, s: StreamLog, source: AsyncIterator[str]) -> None:
        try:
            async for text in source:
                self.nbytes += s.append(text)
                if self.nbytes > self.config.max_bytes:
                    self._shrink()
        except asyncio.CancelledError:
            pass  # no reader came back within the grace window: the source was closed (its requests aborted)
        except Exception:  # a bug in an endpoint's generator: its readers see the stream end
            log.exception("stream %s failed", s.sid)
        finally:
            s.finish()
            await source.aclose()

    # ------------------------------------------------------------ reading
    def response(self, s: StreamLog, start: int) -> StreamingResponse:
        return IdleBoundedStream(self._serve(s, start), self.idle_s, media_type="text/event-stream",
                                 headers=SSE_HEADERS)

    async def _serve(self, s: StreamLog, start: int) -> AsyncIterator[str]:
        timer = self._grace.pop(s.sid, None)
        if timer is not None:  # a reader is back in time
            timer.cancel()
        events = s.read(start)
        try:
            async for ev in events:
                yield ev
        finally:
            await events.aclose()  # now, not when collected: the reader must be gone before the check below
            if not s.readers and not s.done:
                self._orphaned(s)

    def _orphaned(self, s: StreamLog) -> None:
        """Every reader of a running stream left."""
        if s.keep_running or s.pump is None:
            return
        if self.config.grace_s <= 0:
            s.pump.cancel()
            return
        loop = asyncio.get_running_loop()
        self._grace[s.sid] = loop.call_later(self.config.grace_s, self._expire, s)

    def _expire(self, s: StreamLog) -> None:
        self._grace.pop(s.sid, None)
        if not s.readers and not s.done and s.pump is not None:
            log.info("stream %s: no client came back within %g s; its requests are aborted", s.sid, self.config.grace_s)
            s.pump.cancel()

    def resume(self, request: Request) -> StreamingResponse | None:
        """The rest of the stream a ``Last-Event-ID`` header names; None without one."""
        value = request.headers.get("last-event-id")
        if value is None:
            return None
        parsed = parse_event_id(value)
        if parsed is None:
            raise APIError(400, f"Last-Event-ID {value!r} is not an event id of this server (<stream id>:<n>)",
                           "Last-Event-ID", "invalid_value")
        return self.resume_after(parsed[0], parsed[1], request.url.path)

    def resume_after(self, sid: str, after: int, path: str | None = None) -> StreamingResponse:
        """The events of stream ``sid`` after index ``after`` (-1: all of them)."""
        self.sweep()
        s = self.logs.get(sid)
        if s is None or (path is not None and s.path != path):
            raise APIError(404, f"no stream {sid!r} is retained here (finished streams are kept "
                           f"{self.config.retention_s:g} s)", "Last-Event-ID", "stream_not_found")
        if after + 1 < s.first:
            raise APIError(410, f"the events of stream {sid!r} before {s.first} are no longer retained",
                           "Last-Event-ID", "stream_expired")
        if after + 1 > s.next_index and s.done:
            raise APIError(400, f"stream {sid!r} has only {s.next_index} events", "Last-Event-ID", "invalid_value")
        return self.response(s, after + 1)

    # ------------------------------------------------------------ bounds
    def sweep(self) -> None:
        """Forget finished streams past their retention, and the oldest past the count cap."""
        now = time.monotonic()
        finished = [s for s in self.logs.values() if s.done and not s.readers]
        over = len(finished) - self.config.max_streams
        for i, s in enumerate(finished):
            if i < over or now - (s.ended_at or now) > self.config.retention_s:
                self._drop(s)

    def _shrink(self) -> None:
        for s in [s for s in self.logs.values() if s.done and not s.readers]:
            if self.nbytes <= self.config.max_bytes:
                return
            self._drop(s)
        live = sorted(self.logs.values(), key=lambda s: -s.nbytes)
        for s in live:
            if self.nbytes <= self.config.max_bytes:
                return
            freed = s.trim(s.needed_from())
            self.nbytes -= freed
            if freed:
                log.warning("stream %s: events before %d dropped (--stream-max-mb reached)", s.sid, s.first)

    def _drop(self, s: StreamLog) -> None:
        self.logs.pop(s.sid, None)
        self.nbytes -= s.nbytes
