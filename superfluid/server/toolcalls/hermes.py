"""Hermes-style calls (NousHermes, Qwen2.5, Qwen3, and this server's fallback prompt):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call, anywhere in the text. A block the text ends inside of still counts
when its JSON is whole (models often stop before ``</tool_call>``).
"""

from __future__ import annotations

import json

from .scan import CloseSearch, Scanner

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def json_call(obj) -> tuple[str, object] | None:
    """``{"name": ..., "arguments" | "parameters": ...}`` as (name, arguments), else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return obj["name"], obj.get("arguments", obj.get("parameters", {}))


def loads(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


class Closed:
    """A region that ends at its close marker; ``parse`` reads the text between the two."""

    def __init__(self, open_: str, close: str, parse):
        self.open, self.close, self.parse = open_, close, parse
        self._search = CloseSearch(close)

    def feed(self, text: str) -> int | None:
        return self._search.feed(text)

    def calls(self, raw: str, final: bool):
        body = raw[len(self.open):]
        if body.endswith(self.close):
            body = body[: -len(self.close)]
        elif not final:
            return None
        return self.parse(body)


def _hermes_body(body: str):
    call = json_call(loads(body))
    return [call] if call is not None else None


class Hermes(Scanner):
    opens = (OPEN,)

    def region(self, marker: str):
        return Closed(OPEN, CLOSE, _hermes_body)
