"""Bounds at the door: what a request may cost the server before it is refused.

- The body: at most ``max_body_bytes`` (default 8 MiB), read before the app sees it, so a
  10 MB body costs the reading of 8 MiB and a 413, never a JSON parse or a tokenizer run.
- Prompt text: at most ``max_prompt_chars`` characters (default: 32 per context token)
  before it is tokenised.
- Headers: uvicorn's h11 limit (``H11_MAX_HEADER_BYTES``, set by ``superfluid serve``, which
  keeps uvicorn on h11: httptools has no bound). h11 refuses a header block still incomplete
  past it, so a block that arrives in one read may be as large as that read.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from ..engine.params import MAX_N_CAP
from .errors import error_body

H11_MAX_HEADER_BYTES = 32 * 1024  # request line + headers; uvicorn answers 400 past it
CHARS_PER_TOKEN_CAP = 32  # no tokenizer here packs more characters into one token


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 8 << 20
    max_prompt_chars: int = 0  # 0: CHARS_PER_TOKEN_CAP x the model's context
    body_timeout_s: float = 30.0  # the whole body must arrive within this (408 otherwise)
    stream_idle_s: float = 60.0  # a stream whose client reads nothing this long is cut off


def limits_from_args(args) -> Limits:
    """The server's per-request bounds from ``superfluid serve``'s flags (one engine or a cluster)."""
    if not 1 <= args.max_n <= MAX_N_CAP:
        raise ValueError(f"--max-n must be in [1, {MAX_N_CAP}] (the request models' bound on n)")
    for flag in ("stream_idle_timeout", "header_timeout", "body_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive")
    return Limits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_prompt_chars=args.max_prompt_chars,
                  body_timeout_s=args.body_timeout, stream_idle_s=args.stream_idle_timeout)


class BodyLimit:
    """ASGI middleware: a body over ``max_bytes`` is answered 413 with OpenAI's error body."""

    def __init__(self, app, max_bytes: int, read_timeout: float = 30.0):
        self.app, self.max_bytes, self.read_timeout = app, max_bytes, read_timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._too_large(send)
        chunks, size = [], 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        while True:  # buffer the body (bounded in size and time), then hand it to the app as one message
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within {self.read_timeout:g} s",
                                          "request_timeout")
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(chunk)
            if not msg.get("more_body"):
                break
        body, delivered = b"".join(chunks), False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later reads wait for the disconnect, as before

        await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        await self._refuse(send, 413, f"the request body is larger than {self.max_bytes} bytes", "request_too_large")

    async def _refuse(self, send, status: int, message: str, code: str) -> None:
        payload = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})


def prompt_char_cap(limits: Limits, max_seq_len: int) -> int:
    return limits.max_prompt_chars or CHARS_PER_TOKEN_CAP * max(max_seq_len, 1)
