"""Pythonic calls (Llama 3.2 and 4's pythonic templates, ToolACE): the answer is a Python
list of calls with keyword arguments, Llama 4's between ``<|python_start|>`` and
``<|python_end|>``:

    [get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]

A ``[`` opens calls only where the answer (or the previous list) begins; arguments are
Python literals (``true``/``false``/``null`` read as JSON's). A list that is not all
calls with literal keyword arguments stays content.
"""

from __future__ import annotations

import ast
import json

from .hermes import Closed
from .scan import PyEnd, Scanner

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _value(node: ast.AST):
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_value(x) for x in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):
            raise ValueError("** in a dict")
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_call(node: ast.AST, source: str | None = None) -> tuple[str, dict] | None:
    """``f(a=1)`` as (name, arguments), else None. With ``source`` (the text ``node`` was
    parsed from: calls written under the JSON value grammar), each value is read as JSON."""
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
        return None
    if any(k.arg is None for k in node.keywords):  # **kwargs
        return None
    if source is not None:
        return ast.unparse(node.func), {k.arg: json.loads(ast.get_source_segment(source, k.value)) for k in node.keywords}
    return ast.unparse(node.func), {k.arg: _value(k.value) for k in node.keywords}


def parse_list(text: str):
    """``[f(a=1), g()]`` as calls, else None."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
        if not isinstance(tree.body, ast.List) or not tree.body.elts:
            return None
        calls = [parse_call(x) for x in tree.body.elts]
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None
    return None if any(c is None for c in calls) else calls


class _List:
    def __init__(self):
        self._end = PyEnd()
        self._end.feed("[")
        self.done = False

    def feed(self, text: str) -> int | None:
        end = self._end.feed(text)
        self.done = end is not None
        return end

    def calls(self, raw: str, final: bool):
        return parse_list(raw) if self.done else None


class Pythonic(Scanner):
    opens = (PYTHON_START,)
    leads = ("[",)

    def region(self, marker: str):
        if marker == PYTHON_START:
            return Closed(PYTHON_START, PYTHON_END, parse_list)
        return _List()
