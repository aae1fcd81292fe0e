"""Calls under the tool grammar in the families whose calls are not JSON: Qwen3-Coder's
XML and pythonic lists, written in the family's own syntax, and the readers of that output.

The grammar is built from xgrammar's structural tags, one call per function:

    qwen3_coder  <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>...</function>\\n</tool_call>
                 (xgrammar's ``qwen_xml`` style: a string value as raw text, others as JSON;
                 at most one whitespace character where the style allows any)
    pythonic     [NAME(K=V, ...), ...]   (each V a JSON value following K's schema; the
                 required keys first, in the schema's order, then the optional ones, each optional)

``sep`` ("\\n" / ", ") between calls, at most ``max_calls``. A tool list this framing
cannot say exactly (pythonic: a name that is not a Python identifier, a top-level schema
with keywords other than properties and required, ``$ref``s) gets no native grammar:
``native_grammar`` answers None and the caller frames the calls in Hermes' JSON instead.

The readers turn the output into the events ``ForcedStream`` takes (("call", name),
("args", json), ("end",)), all three when a call is complete: these arguments are not
JSON as written, so they go out whole. A call cut short by ``max_tokens`` never completes
and never goes out.
"""

from __future__ import annotations

import ast
import json
import keyword
import warnings

import xgrammar as xgr
from xgrammar import structural_tag as st

from .pythonic import parse_call
from .qwen3_xml import Qwen3Xml
from .scan import Found, PyEnd
from .validate import ToolSchemas

NATIVE = ("qwen3_coder", "pythonic")
_SEEK_LIMIT = 4096  # a call's name and the framing before it are far shorter
_PLAIN_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema"}
MAX_OPTIONAL_FIRST = 8  # pythonic, no required key: the optional-first alternatives grow as n^2


def native_grammar(family: str, functions: list[dict], max_calls: int) -> str | None:
    """The EBNF of 1..max_calls calls of ``functions`` in the family's syntax, or None."""
    try:
        if family == "qwen3_coder":
            fmt = _calls([_xml_call(f) for f in functions], "\n", max_calls)
        elif family == "pythonic" and all(_pythonic_ok(f) for f in functions):
            fmt = st.SequenceFormat(elements=[_const("["), _calls([_py_call(f) for f in functions], ", ", max_calls),
                                              _const("]")])
        else:
            return None
        return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=fmt)))
    except (RuntimeError, ValueError, TypeError):  # a schema xgrammar cannot put in this style
        return None


def _const(text: str) -> st.ConstStringFormat:
    return st.ConstStringFormat(value=text)


def _one_of(items: list) -> object:
    return items[0] if len(items) == 1 else st.OrFormat(elements=items)


def _calls(calls: list, sep: str, max_calls: int) -> object:
    one = _one_of(calls)
    if max_calls <= 1:
        return one
    more = st.RepeatFormat(min=0, max=max_calls - 1, content=st.SequenceFormat(elements=[_const(sep), one]))
    return st.SequenceFormat(elements=[one, more])


def _xml_call(f: dict) -> st.TagFormat:
    return st.TagFormat(begin=f"<tool_call>\n<function={f['name']}>\n",
                        content=st.JSONSchemaFormat(json_schema=f["parameters"], style="qwen_xml", max_whitespace_cnt=1),
                        end="</function>\n</tool_call>")


def _pythonic_ok(f: dict) -> bool:
    p = f["parameters"]
    names = [f["name"], *(p.get("properties") or {})]
    if not all(isinstance(n, str) and n.isidentifier() and not keyword.iskeyword(n) for n in names):
        return False
    if set(p) - _PLAIN_KEYS or "$ref" in json.dumps(p):
        return False
    props, required = p.get("properties") or {}, p.get("required") or []
    if not set(required) <= set(props):  # a required key with no schema: JSON framing says it
        return False
    return bool(required) or len(props) <= MAX_OPTIONAL_FIRST


def _value(schema) -> st.GrammarFormat:
    text = json.dumps(schema if isinstance(schema, dict) and schema else {})
    return st.GrammarFormat(grammar=str(xgr.Grammar.from_json_schema(text, any_whitespace=False)))


def _py_call(f: dict) -> st.SequenceFormat:
    p = f["parameters"]
    props, required = p.get("properties") or {}, list(p.get("required") or [])
    optional = [k for k in props if k not in required]

    def item(k: str, first: bool) -> list:
        return [_const(f"{'' if first else ', '}{k}="), _value(props[k])]

    def tail(keys: list[str]) -> list:
        return [st.OptionalFormat(content=st.SequenceFormat(elements=item(k, False))) for k in keys]

    if required:
        args = [x for i, k in enumerate(required) for x in item(k, i == 0)] + tail(optional)
    elif optional:  # the first key written has no separator: one alternative per first key
        firsts = [st.SequenceFormat(elements=item(k, True) + tail(optional[i + 1:])) for i, k in enumerate(optional)]
        args = [st.OptionalFormat(content=_one_of(firsts))]
    else:
        args = []
    return st.SequenceFormat(elements=[_const(f"{f['name']}("), *args, _const(")")])


def _whole(schemas: ToolSchemas, name: str, args: dict) -> list[tuple]:
    # the grammar admitted only valid calls; a value this reading types differently from the
    # grammar's is still the call's, as JSON
    text = schemas.arguments(name, args) or json.dumps(args, ensure_ascii=False)
    return [("call", name), ("args", text), ("end",)]


class XmlReader:
    """Qwen3-Coder's calls: each goes out when its ``</tool_call>`` is written."""

    def __init__(self, schemas: ToolSchemas):
        self.schemas = schemas
        self._scanner = Qwen3Xml(schemas.params)

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        for it in self._scanner.feed(text, final=False):
            if isinstance(it, Found):  # framing whitespace is all the grammar writes beside calls
                for name, args in it.calls:
                    out += _whole(self.schemas, name, args)
        return out


class PythonicReader:
    """A pythonic list's calls: each goes out when its closing parenthesis is written."""

    def __init__(self, schemas: ToolSchemas):
        self.schemas = schemas
        self._head = ""  # the text before the open call's "(": separators and its name
        self._body: list[str] = []  # the open call's text from its "("
        self._end: PyEnd | None = None

    def feed(self, text: str) -> list[tuple]:
        out: list[tuple] = []
        while text:
            if self._end is None:
                i = text.find("(")
                if i < 0:
                    self._head = (self._head + text)[-_SEEK_LIMIT:]
                    break
                self._head, self._end, self._body = self._head + text[:i], PyEnd(), []
                text = text[i:]
                continue
            end = self._end.feed(text)
            if end is None:
                self._body.append(text)
                break
            self._body.append(text[:end])
            text = text[end:]
            name = self._head.lstrip("[, \n")
            call = _parse(name + "".join(self._body))
            if call is not None:
                out += _whole(self.schemas, *call)
            self._head, self._end, self._body = "", None, []
        return out


def _parse(text: str) -> tuple[str, dict] | None:
    with warnings.catch_warnings():  # JSON's "\/" is an unknown escape to Python (the values are read as JSON)
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # what Python 3.11 calls it
        try:
            return parse_call(ast.parse(text, mode="eval").body, source=text)
        except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):  # JSONDecodeError is a ValueError
            return None


def native_reader(family: str, schemas: ToolSchemas) -> XmlReader | PythonicReader:
    return XmlReader(schemas) if family == "qwen3_coder" else PythonicReader(schemas)
