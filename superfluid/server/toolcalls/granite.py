"""Granite 3.x calls: ``<|tool_call|>`` (a special token, kept in the text) and a JSON list
of call objects, as its template asks ("respond only with <|tool_call|> followed by a JSON
list of tools used"):

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

Content before the marker is content.
"""

from __future__ import annotations

from .llama3 import JsonRegion
from .mistral import json_list
from .scan import Scanner

TOOL_CALL = "<|tool_call|>"


class Granite(Scanner):
    opens = (TOOL_CALL,)

    def region(self, marker: str):
        return JsonRegion(marker, False, json_list, tail="")
