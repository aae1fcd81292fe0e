"""A Responses request -> the chat request it means, and the prompt cache key of its conversation.

The chat request is what a client would send for the same turn with the whole history
(items.py): the chat endpoint's own code then renders the template, plans the tools, builds
the sampling params and tokenizes (``chat.tokenized``), so both endpoints give one prompt.

The cache key: a stored conversation names ``prompt_cache_key`` "conv-<id of its first
response>" (or the client's own key) with ``prompt_cache_retention`` "24h", unless the
client names others. Every turn's lane publishes its KV under that key, so the entries are
protected within the cache's quota, exported to host memory first under pressure and
dropped last (engine/cache_keys.py), and the next turn leases them instead of prefilling;
with ``--replicas`` the same key routes every turn to the replica that holds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...engine.params import ParamError
from ..protocol import ChatCompletionRequest
from . import items as item_codec
from .models import ResponsesRequest

CONVERSATION_RETENTION = "24h"


@dataclass(frozen=True)
class CacheKey:
    key: str | None
    retention: str | None

    @classmethod
    def of(cls, body: ResponsesRequest, rid: str, previous: dict | None) -> "CacheKey":
        if previous is not None:
            key = body.prompt_cache_key or previous["conversation"]
            return cls(key, body.prompt_cache_retention or previous["retention"])
        if body.store:
            return cls(body.prompt_cache_key or f"conv-{rid}", body.prompt_cache_retention or CONVERSATION_RETENTION)
        return cls(body.prompt_cache_key, body.prompt_cache_retention)


def chat_request(body: ResponsesRequest, history: list[dict], cache: CacheKey) -> ChatCompletionRequest:
    """The chat request of this turn: instructions, the history and this turn's items."""
    fields = dict(
        model=body.model,
        messages=item_codec.messages(body.instructions, history),
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        seed=body.seed,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        ignore_eos=body.ignore_eos,
        priority=body.priority,
        timeout=body.timeout,
        prompt_cache_key=cache.key,
        prompt_cache_retention=cache.retention,
        parallel_tool_calls=body.parallel_tool_calls,
        tools=_tools(body),
        tool_choice=_tool_choice(body),
        response_format=_format(body),
    )
    return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})


def _tools(body: ResponsesRequest) -> list[dict] | None:
    if not body.tools:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.type != "function":
            raise ParamError(f"tools.{i}: tools of type {t.type!r} are not served here (only function tools)",
                             f"tools.{i}.type")
        if not t.name:
            raise ParamError(f"tools.{i}.name is required", f"tools.{i}.name")
        fn = {"name": t.name, "description": t.description, "parameters": t.parameters}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _tool_choice(body: ResponsesRequest):
    c = body.tool_choice
    if c is None or isinstance(c, str):
        return c
    return {"type": "function", "function": {"name": c.name}}


def _format(body: ResponsesRequest) -> dict | None:
    f = body.text.format if body.text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.schema_ is None:
        raise ParamError("text.format of type json_schema needs a 'schema'", "text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": f.name, "schema": f.schema_, "strict": f.strict}}


def text_config(body: ResponsesRequest) -> dict:
    """The ``text`` field of the response object: the format as asked."""
    f = body.text.format if body.text is not None else None
    if f is None:
        return {"format": {"type": "text"}}
    return {"format": f.model_dump(by_alias=True, exclude_none=True)}
