"""Qwen3-Coder's XML calls:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text; it is read by the type its schema gives it (a string
stays text, numbers, booleans, null, objects and arrays are parsed), untyped values as
JSON when they parse. A ``<function=...>`` block written without the ``<tool_call>``
around it counts too.
"""

from __future__ import annotations

import ast
import re

from .hermes import CLOSE, OPEN, Closed, loads
from .scan import Scanner

_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|\Z)", re.S)
_PARAM = re.compile(r"<parameter=([^>]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_MISSING = object()


def _types(prop) -> list[str]:
    t = prop.get("type") if isinstance(prop, dict) else None
    return [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []


def typed(value: str, prop) -> object:
    """A parameter's text as the value its schema's type asks for (as written when it
    does not read as one: the schema check then says no)."""
    types = _types(prop)
    if "null" in types and value.strip() == "null":
        return None
    if "string" in types:
        return value
    for t in types or ["json"]:
        got = _as(t, value.strip())
        if got is not _MISSING:
            return got
    return value


def _as(t: str, v: str) -> object:
    if t == "boolean":
        return {"true": True, "false": False}.get(v.lower(), _MISSING)
    if t in ("integer", "number"):
        try:
            return int(v)
        except ValueError:
            pass
        if t == "number":
            try:
                return float(v)
            except ValueError:
                pass
        return _MISSING
    got = loads(v)
    if got is None and v != "null" and t in ("object", "array"):
        try:
            got = ast.literal_eval(v)  # a Python literal: single quotes, True/False
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return _MISSING
    return _MISSING if got is None and v != "null" else got


class Qwen3Xml(Scanner):
    opens = (OPEN, "<function=")

    def region(self, marker: str):
        if marker == OPEN:
            return Closed(OPEN, CLOSE, self._parse)
        return Closed("", "</function>", self._parse)  # the marker is part of the body

    def _parse(self, body: str):
        calls, pos = [], 0
        for m in _FUNCTION.finditer(body):
            if body[pos : m.start()].strip():
                return None  # text beside the function blocks: not a call
            name, inner = m.group(1), m.group(2)
            props = (self.schemas.get(name) or {}).get("properties") or {}
            args, at = {}, 0
            for p in _PARAM.finditer(inner):
                if inner[at : p.start()].strip():
                    return None
                key = p.group(1).strip()
                args[key] = typed(p.group(2).strip("\n"), props.get(key))
                at = p.end()
            if inner[at:].strip():
                return None
            calls.append((name, args))
            pos = m.end()
        return calls if calls and not body[pos:].strip() else None
