"""An SSE response that cuts off a client that stops reading.

A chunk the transport cannot take within ``idle_s`` (its buffers are full because nobody
reads) ends the response and closes the connection; closing the event generator then
lets the stream hub treat the reader as gone (the grace window, then the request is
aborted), so its lane is freed while every other stream goes on.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import StreamingResponse

log = logging.getLogger("superfluid.server")


class IdleBoundedStream(StreamingResponse):
    def __init__(self, content, idle_s: float, **kw):
        super().__init__(content, **kw)
        self.idle_s = idle_s

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        try:
            async for chunk in self.body_iterator:
                if not isinstance(chunk, (bytes, memoryview)):
                    chunk = chunk.encode(self.charset)
                try:
                    await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                           self.idle_s)
                except asyncio.TimeoutError:
                    log.warning("a streaming client read nothing for %g s: cut off", self.idle_s)
                    return  # uvicorn closes a connection whose response did not complete
        finally:
            await self.body_iterator.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
