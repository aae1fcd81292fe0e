"""Bounds on JSON that a request hands to a grammar compiler or a template.

A schema (``json_schema``, ``guided_json``, a tool's parameters) or tool-call arguments
nested past ``MAX_DEPTH`` levels, or a schema longer than ``MAX_SCHEMA_CHARS`` as JSON, is
a 400 naming its field: deep nesting would otherwise reach a recursive walk (Python's
json, xgrammar's schema converter, a Jinja filter) and end as a RecursionError 500 or a
compile that runs for minutes. The depth is measured without recursion.
"""

from __future__ import annotations

import json

from ..engine.params import ParamError

MAX_DEPTH = 64
MAX_SCHEMA_CHARS = 256 * 1024


def depth(value) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0), iteratively."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, d + 1)
        if d + 1 > MAX_DEPTH:
            return d + 1  # far enough: the verdict is known
        stack.extend((c, d + 1) for c in children)
    return deepest


def check_nesting(value, param: str) -> None:
    if depth(value) > MAX_DEPTH:
        raise ParamError(f"{param} is nested more than {MAX_DEPTH} levels deep", param)


def loads(text: str, param: str):
    """JSON text of a request field, decoded; ParamError (naming it) for bad or too-deep JSON."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ParamError(f"{param} is not JSON: {e}", param) from None
    except RecursionError:
        raise ParamError(f"{param} is nested more than {MAX_DEPTH} levels deep", param) from None
    check_nesting(value, param)
    return value


def schema_text(schema, param: str) -> str:
    """A schema (decoded or JSON text) as JSON text, within the depth and size bounds."""
    if isinstance(schema, str):
        if len(schema) > MAX_SCHEMA_CHARS:
            raise ParamError(f"{param} is longer than {MAX_SCHEMA_CHARS} characters", param)
        schema = loads(schema, param)
    check_nesting(schema, param)
    text = json.dumps(schema)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ParamError(f"{param} is longer than {MAX_SCHEMA_CHARS} characters as JSON", param)
    return text
