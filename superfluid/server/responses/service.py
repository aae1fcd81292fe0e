"""What ``/v1/responses`` does: create a response (whole, streamed or in the background),
read one back, delete one.

Creating: the previous response (if named) is read from the store; its conversation's
items plus this turn's become the chat request of the turn (request.py), which the chat
endpoint's own code renders, tokenizes and checks; the prompt is submitted under the
conversation's cache key; the response is built from the deltas (stream.py) and stored at its
end. A response in flight is ``live`` (a GET shows its progress) until it is stored.

Disconnects: a streamed response with ``store: true`` runs to its end without a reader and
stays resumable (stream_hub.py); with ``store: false`` it is a chat-like stream (a grace
window, then aborted). A whole response whose client leaves is aborted and not stored.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pydantic
from fastapi import Request
from starlette.concurrency import run_in_threadpool

from ..chat import tokenized
from ..deadline import deadline_s
from ..errors import APIError
from ..responder import Reply
from ..serving import Serving, invalid_params
from ..stream_log import parse_event_id
from . import items as item_codec
from . import stream
from .build import ResponseBuild
from .models import ResponsesRequest
from .request import CacheKey, chat_request, text_config
from .store import ResponseStore

PATH = "/v1/responses"


class Responses:
    def __init__(self, serving: Serving, store: ResponseStore):
        self.serving = serving
        self.store = store
        self.live: dict[str, ResponseBuild] = {}
        self._stored: dict[str, bool] = {}  # live id -> whether it will be stored

    async def create(self, body: ResponsesRequest, request: Request):
        hub = self.serving.streams
        resumed = hub.resume(request) if body.stream else None
        if resumed is not None:
            return resumed
        self.serving.check_model(body.model)
        if body.background and not body.store:
            raise APIError(400, "background responses must be stored (store: true)", "background", "invalid_value")
        previous = await self._previous(body.previous_response_id)
        rid = f"resp_{uuid.uuid4().hex}"
        turn = await self._turn(body, rid, previous)
        self.live[rid] = turn.build
        self._stored[rid] = body.store
        if body.stream or body.background:
            source = stream.events(turn)
            if body.stream:
                return hub.record(rid, PATH, source, keep_running=body.store)
            hub.start(rid, PATH, source, keep_running=True)
            return turn.build.snapshot()
        return await stream.whole(request, turn)

    async def _turn(self, body: ResponsesRequest, rid: str, previous: dict | None) -> stream.Turn:
        with invalid_params():
            history = (previous["items"] if previous else []) + item_codec.canonical(body.input)
            cache = CacheKey.of(body, rid, previous)
            try:
                chat = chat_request(body, history, cache)
            except pydantic.ValidationError as e:
                raise APIError(400, f"the conversation is not a valid chat: {e.errors()[0].get('msg')}", "input",
                               "invalid_value") from None
        ids, plan, params = await run_in_threadpool(tokenized, chat, self.serving)
        streams = await self.serving.submit(rid, [ids], params, cache.key)
        reply = Reply(rid, int(time.time()), self.serving.name, streams, 1,
                      deadline_s(body.timeout, self.serving.request_timeout))
        build = ResponseBuild(_head(body, rid, reply.created, self.serving.name, cache), plan)
        return stream.Turn(build, reply, ids, history, lambda t, done: self._end(t, done, cache))

    async def _previous(self, rid: str | None) -> dict | None:
        if rid is None:
            return None
        found = await asyncio.to_thread(self.store.get, rid)
        if found is not None:
            return found
        if rid in self.live:
            raise APIError(400, f"Previous response with id '{rid}' is still in progress.", "previous_response_id",
                           "previous_response_in_progress")
        raise APIError(404, f"Previous response with id '{rid}' not found.", "previous_response_id",
                       "previous_response_not_found")

    async def _end(self, turn: stream.Turn, done: bool, cache: CacheKey) -> None:
        rid = turn.build.id
        try:
            if done and self._stored.get(rid):
                obj = turn.build.snapshot()
                items = turn.history + obj["output"]
                await asyncio.to_thread(self.store.put, obj, items, turn.prompt_ids + turn.output_ids, cache.key,
                                        cache.retention)
        finally:
            self.live.pop(rid, None)
            self._stored.pop(rid, None)

    # ------------------------------------------------------------ reading back
    async def get(self, rid: str) -> dict:
        if rid in self.live and self._stored.get(rid):
            return self.live[rid].snapshot()
        found = await asyncio.to_thread(self.store.get, rid)
        if found is None:
            raise APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")
        return found["object"]

    def stream(self, rid: str, request: Request, starting_after: int | None):
        """The response's events after ``starting_after`` (or the ``Last-Event-ID`` header's), else all."""
        after = starting_after
        if after is None:
            named = parse_event_id(request.headers.get("last-event-id") or "")
            after = named[1] if named is not None and named[0] == rid else -1
        return self.serving.streams.resume_after(rid, after)

    async def delete(self, rid: str) -> dict:
        if await asyncio.to_thread(self.store.delete, rid):
            return {"id": rid, "object": "response", "deleted": True}
        if rid in self.live:
            raise APIError(400, f"Response with id '{rid}' is still in progress; delete it once it ends.",
                           "response_id", "response_in_progress")
        raise APIError(404, f"Response with id '{rid}' not found.", "response_id", "not_found")


def _head(body: ResponsesRequest, rid: str, created: int, model: str, cache: CacheKey) -> dict:
    return {
        "id": rid, "object": "response", "created_at": created, "background": body.background,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": body.previous_response_id,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "tool_choice": _choice(body.tool_choice), "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
        "text": text_config(body), "truncation": body.truncation or "disabled", "metadata": body.metadata or {},
        "store": body.store, "user": body.user, "prompt_cache_key": cache.key,
        "prompt_cache_retention": cache.retention, "reasoning": {"effort": None, "summary": None},
    }


def _choice(c) -> str | dict:
    if c is None:
        return "auto"
    return c if isinstance(c, str) else c.model_dump(exclude_none=True)
