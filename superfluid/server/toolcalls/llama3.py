"""Llama 3.x JSON calls: the answer is a call object (after ``<|python_tag|>`` in 3.1's
builtin format), several separated by ``;``:

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}

A ``{`` opens a call only where the answer (or the previous call) ends; a JSON object in
the middle of prose is prose. ``<|python_tag|>`` opens one anywhere; what follows it that
is not a JSON object (3.1's code interpreter) stays content, tag included.
"""

from __future__ import annotations

from .hermes import json_call, loads
from .scan import JsonEnd, Scanner

PYTHON_TAG = "<|python_tag|>"


class JsonRegion:
    """One JSON value after the marker (or starting with it, ``inside``), then the
    characters of ``tail`` that follow it (separators, whitespace)."""

    def __init__(self, marker: str, inside: bool, parse, tail: str = " \t\r\n"):
        self.marker, self.inside, self.parse, self.tail = marker, inside, parse, tail
        self._json = JsonEnd()
        self._done = False
        if inside:
            self._json.feed(marker)

    def feed(self, text: str) -> int | None:
        i = 0
        if not self._done:
            end = self._json.feed(text)
            if end is None:
                return None
            if self._json.failed:
                return end
            self._done, i = True, end
        n = len(text)
        while i < n and text[i] in self.tail:
            i += 1
        return i if i < n else None

    def calls(self, raw: str, final: bool):
        if not self._done or self._json.failed:
            return None
        body = raw if self.inside else raw[len(self.marker):]
        return self.parse(loads(body.rstrip(self.tail)))


def _one_call(obj):
    call = json_call(obj)
    return [call] if call is not None else None


class Llama3Json(Scanner):
    opens = (PYTHON_TAG,)
    leads = ("{",)

    def region(self, marker: str):
        return JsonRegion(marker, marker == "{", _one_call, tail=" \t\r\n;")
