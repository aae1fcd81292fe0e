"""Mistral's calls, after the ``[TOOL_CALLS]`` control token (kept in the text: the
request decodes with special tokens, see registry.py). Two generations of syntax:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]     (v3 and earlier)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]{"a": 1}        (v11 and later)

and ``name[CALL_ID]id[ARGS]{...}`` in between. Content before the first marker is content.
"""

from __future__ import annotations

import re

from .hermes import json_call, loads
from .llama3 import JsonRegion
from .scan import JsonEnd, Scanner

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME = re.compile(r"\s{0,32}([a-zA-Z0-9_.-]{1,64})(?:\[CALL_ID\][^\[]{0,64})?\[ARGS\]")


def json_list(value):
    """A JSON array of call objects (or one object) as calls, else None."""
    items = value if isinstance(value, list) else [value] if isinstance(value, dict) else None
    if not items:
        return None
    calls = [json_call(x) for x in items]
    return None if any(c is None for c in calls) else calls


class _Named:
    """``name[ARGS]{...}``: the head is read whole (bounded: at most 32 spaces, a 64-char name,
    a 64-char call id and the markers), then the arguments' object.
    A head that cannot become one ends the region after its name; the rest is read again
    as content (it may hold the next marker)."""

    def __init__(self):
        self._head = ""
        self._json: JsonEnd | None = None
        self.name: str | None = None
        self.done = False

    def feed(self, text: str) -> int | None:
        if self._json is not None:
            end = self._json.feed(text)
            self.done = end is not None and not self._json.failed
            return end
        before = len(self._head)
        self._head += text
        m = _NAME.match(self._head)
        if m is None:
            keep = _head_end(self._head)
            if keep is None:
                return None
            return keep - before  # may be negative: text read in earlier pushes goes back
        self.name, self._json = m.group(1), JsonEnd()
        end = self.feed(self._head[m.end():])
        return None if end is None else m.end() - before + end


_NAME_CHARS = re.compile(r"\s{0,32}[a-zA-Z0-9_.-]{0,64}")
_CALL_ID_HEAD = re.compile(r"\[CALL_ID\][^\[]{0,64}")


def _head_end(head: str) -> int | None:
    """None while ``head`` can still grow into ``name[CALL_ID]id[ARGS]``; else where its
    name ends (what follows is not a call's)."""
    name_end = _NAME_CHARS.match(head).end()
    rest = head[name_end:]
    if not rest or ARGS.startswith(rest) or CALL_ID.startswith(rest):
        return None
    m = _CALL_ID_HEAD.match(rest)
    if m is not None and (m.end() == len(rest) or ARGS.startswith(rest[m.end():])):
        return None
    return name_end


class MistralRegion:
    """After ``[TOOL_CALLS]``: a JSON array or object, or a named call."""

    def __init__(self):
        self._inner = None

    def feed(self, text: str) -> int | None:
        j = 0
        if self._inner is None:  # whitespace before the syntax is skipped here, whoever reads it
            j = len(text) - len(text.lstrip())
            if j == len(text):
                return None
            self._inner = JsonRegion("", False, json_list, tail="") if text[j] in "[{" else _Named()
        end = self._inner.feed(text[j:] if j else text)
        return None if end is None else end + j

    def calls(self, raw: str, final: bool):
        body = raw[len(TOOL_CALLS):].lstrip()
        inner = self._inner
        if isinstance(inner, JsonRegion):
            return inner.calls(body, final)
        if isinstance(inner, _Named) and inner.done:
            m = _NAME.match(body)
            args = loads(body[m.end():])
            return [(inner.name, args)] if args is not None else None
        return None


class Mistral(Scanner):
    opens = (TOOL_CALLS,)

    def region(self, marker: str):
        return MistralRegion()
