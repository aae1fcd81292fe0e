"""Responses items <-> chat messages.

A conversation is a list of items: input messages (``role`` + text), the model's output
messages, ``function_call`` items (the model called a tool) and ``function_call_output``
items (the client's answer to a call). Stored conversations hold them in the canonical
form ``canonical`` gives, so that a later turn renders them exactly as this one did.

Rendering goes through the chat endpoint: ``messages`` turns items into the chat messages
a client would have sent for the same conversation -- an output message and the calls
after it are one assistant turn with ``tool_calls``, a call's output is a ``tool`` turn --
so a conversation carried by ``previous_response_id`` gets the very prompt of the same
turns sent as a full chat history.
"""

from __future__ import annotations

from ...engine.params import ParamError

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")


def canonical(raw: str | list[dict]) -> list[dict]:
    """A request's ``input`` as canonical items; ParamError naming ``input.N...``."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not raw:
        raise ParamError("input must not be empty", "input")
    return [_item(i, it) for i, it in enumerate(raw)]


def _item(i: int, it: dict) -> dict:
    kind = it.get("type", "message" if "role" in it else None)
    if kind == "message":
        role = it.get("role")
        if role not in ROLES:
            raise ParamError(f"input.{i}.role must be one of {', '.join(ROLES)}, got {role!r}", f"input.{i}.role")
        return {"type": "message", "role": role, "content": _text(it.get("content"), f"input.{i}.content")}
    if kind == "function_call":
        call = {"type": "function_call", "call_id": _str(it, "call_id", i), "name": _str(it, "name", i),
                "arguments": _str(it, "arguments", i)}
        if it.get("id") is not None:
            call["id"] = str(it["id"])
        return call
    if kind == "function_call_output":
        return {"type": "function_call_output", "call_id": _str(it, "call_id", i),
                "output": _text(it.get("output"), f"input.{i}.output")}
    raise ParamError(f"input.{i}: items of type {kind!r} are not supported (message, function_call and "
                     "function_call_output are)", f"input.{i}.type")


def _str(it: dict, key: str, i: int) -> str:
    v = it.get(key)
    if not isinstance(v, str):
        raise ParamError(f"input.{i}.{key} must be a string", f"input.{i}.{key}")
    return v


def _text(content, param: str) -> str:
    """A string, or text parts joined; any other part (images, files) is a 400 naming it:
    this server reads text only, and dropping a part would answer another question."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ParamError(f"{param} must be a string or a list of text parts", param)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text", ""), str):
            raise ParamError(f"{param}.{j}: content parts of type {kind!r} are not supported (this model reads "
                             "text only; send parts of type 'input_text')", f"{param}.{j}.type")
        out.append(part.get("text", ""))
    return "".join(out)


def messages(instructions: str | None, items: list[dict]) -> list[dict]:
    """The chat messages of a conversation (canonical items or output items)."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for it in items:
        kind = it["type"]
        if kind == "message":
            out.append({"role": it["role"], "content": _text(it["content"], "input")})
        elif kind == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the calls of one model turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out
