"""Chat messages as OpenAI sends them -> the dicts a chat template renders.

- ``content`` is a string or a list of parts; text parts are joined, any other part
  (images, audio, files) is a 400 naming ``messages.N.content.M.type``: this server
  serves text models only, and silently dropping a part would answer another question.
- ``developer`` is OpenAI's newer name for ``system``: chat templates know only the latter.
- ``name`` is passed through (templates that know it render it; the others ignore it).
- An assistant turn's ``tool_calls`` carry their arguments as a JSON string on the wire;
  templates (Hugging Face's convention) want a mapping, so they are parsed here and a
  string that is not a JSON object is a 400 naming it.
"""

from __future__ import annotations

import json

from ..engine.params import ParamError
from . import json_bounds
from .protocol import ChatMessage


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    return [_one(i, m) for i, m in enumerate(messages)]


def _one(i: int, m: ChatMessage) -> dict:
    out: dict = {"role": "system" if m.role == "developer" else m.role, "content": _text(i, m)}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        if m.role != "assistant":
            raise ParamError(f"messages.{i}: only assistant messages carry tool_calls", f"messages.{i}.tool_calls")
        out["tool_calls"] = [_call(i, j, c) for j, c in enumerate(m.tool_calls)]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
    return out


def _text(i: int, m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise ParamError(
                f"messages.{i}.content.{j}: content parts of type {part.type!r} are not supported "
                "(this model reads text only; send parts of type 'text')",
                f"messages.{i}.content.{j}.type",
            )
        texts.append(part.text or "")
    return "".join(texts)


def _call(i: int, j: int, call) -> dict:
    args = call.function.arguments
    param = f"messages.{i}.tool_calls.{j}.function.arguments"
    if isinstance(args, str):
        args = json_bounds.loads(args, param) if args.strip() else {}
    json_bounds.check_nesting(args, param)
    if not isinstance(args, dict):
        raise ParamError(f"messages.{i}.tool_calls.{j}.function.arguments must be a JSON object",
                         param)
    return {"id": call.id or f"call_{i}_{j}", "type": "function", "function": {"name": call.function.name, "arguments": args}}


def total_chars(messages: list[dict]) -> int:
    """What the door's character cap counts: every text a template will render."""
    n = 0
    for m in messages:
        n += len(m["content"])
        for c in m.get("tool_calls", ()):
            n += len(c["function"]["name"]) + len(json.dumps(c["function"]["arguments"]))
    return n
