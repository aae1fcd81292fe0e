"""Calls written under the tool grammar (``tool_choice`` required or named): how each
family frames them, and the eager reader of that output.

The grammar (tools.py) writes ``start``, then each call as ``open`` +
``{"name": "<name>", "<key>": <arguments>}`` + ``close``, ``sep`` between calls, then
``end``: the family's own JSON syntax. The families whose calls are not JSON (Qwen3-Coder's
XML, pythonic) are written in their own syntax by forced_native.py, or in Hermes' framing
where that syntax cannot say a tool list exactly.

The reader needs no tool list and no validation: the grammar admits only calls whose
arguments follow their schema. So a call is announced as soon as its name is whole and
its arguments stream as they are written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .scan import JsonEnd

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SEEK_LIMIT = 4096  # framing and a head are far shorter; what the grammar never writes is not kept


@dataclass(frozen=True)
class Framing:
    open: str
    key: str  # the arguments' key
    close: str
    sep: str
    start: str = ""
    end: str = ""


HERMES = Framing("<tool_call>\n", "arguments", "\n</tool_call>", "\n")
FRAMINGS = {
    "hermes": HERMES,
    "llama3_json": Framing("", "parameters", "", "; "),
    "mistral": Framing("", "arguments", "", ", ", start="[TOOL_CALLS][", end="]"),
    "granite": Framing("", "arguments", "", ", ", start="<|tool_call|>[", end="]"),
}


def framing(family: str) -> Framing:
    return FRAMINGS.get(family, HERMES)


class ForcedReader:
    """Grammar output as events: ("call", name), ("args", fragment), ("end",)."""

    def __init__(self):
        self._seek = ""  # text since the last call's arguments, until the next head
        self._json: JsonEnd | None = None

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        while text:
            if self._json is None:
                self._seek += text
                m = _HEAD.search(self._seek)
                if m is None or m.end() == len(self._seek):  # the head may still grow
                    self._seek = self._seek[-_SEEK_LIMIT:]
                    break
                out.append(("call", json.loads(f'"{m.group(1)}"')))
                text, self._seek, self._json = self._seek[m.end():], "", JsonEnd()
                continue
            end = self._json.feed(text)
            frag = text if end is None else text[:end]
            if frag:
                out.append(("args", frag))
            if end is None:
                break
            out.append(("end",))
            text, self._json = text[end:], None
        return out
