"""Constrained decoding as a request asks for it -> one ``GrammarSpec``.

vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``,
``json_object``), its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``, and OpenAI's ``response_format``. One request names at most one
of vLLM's kinds (a 400 otherwise, as vLLM answers); ``response_format`` applies when
it names none. A ``choice`` is an EBNF alternation of its strings, each a literal;
``grammar`` is EBNF (GBNF), compiled by xgrammar as it is.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from ..engine.params import GrammarSpec, ParamError
from . import json_bounds

MAX_CHOICES = 256
MAX_CHOICE_CHARS = 4096
MAX_GRAMMAR_CHARS = json_bounds.MAX_SCHEMA_CHARS
Choices = Annotated[list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]],
                    Field(min_length=1, max_length=MAX_CHOICES)]
GrammarText = Annotated[str, Field(max_length=MAX_GRAMMAR_CHARS)]


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's backend hints (disable_fallback, ...) change nothing here

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None
    json_object: bool | None = None


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly the choices (JSON's string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _vllm_kinds(req) -> list[GrammarSpec]:
    out: list[GrammarSpec] = []
    so: StructuredOutputs | None = req.structured_outputs
    if so is not None:
        p = "structured_outputs"
        if so.json_ is not None:
            out.append(GrammarSpec("json_schema", json_bounds.schema_text(so.json_, p), p))
        if so.regex is not None:
            out.append(GrammarSpec("regex", so.regex, p))
        if so.choice is not None:
            out.append(GrammarSpec("ebnf", choice_grammar(so.choice), p))
        if so.grammar is not None:
            out.append(GrammarSpec("ebnf", so.grammar, p))
        if so.json_object:
            out.append(GrammarSpec("json_object", "", p))
    if req.guided_json is not None:
        out.append(GrammarSpec("json_schema", json_bounds.schema_text(req.guided_json, "guided_json"), "guided_json"))
    if req.guided_regex is not None:
        out.append(GrammarSpec("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        out.append(GrammarSpec("ebnf", choice_grammar(req.guided_choice), "guided_choice"))
    if req.guided_grammar is not None:
        out.append(GrammarSpec("ebnf", req.guided_grammar, "guided_grammar"))
    return out


def grammar(req) -> GrammarSpec | None:
    """The request's one grammar, or None. ParamError for two kinds or a bad format."""
    kinds = _vllm_kinds(req)
    if len(kinds) > 1:
        raise ParamError("only one kind of structured output may be given (json, regex, choice, grammar or "
                         f"json_object); got {len(kinds)}", kinds[1].param)
    if kinds:
        return kinds[0]
    return _response_format(req.response_format)


def _response_format(rf) -> GrammarSpec | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return GrammarSpec("json_object", "")
    if rf.type == "regex":
        if not rf.regex:
            raise ParamError("response_format of type regex needs a 'regex'", "response_format")
        return GrammarSpec("regex", rf.regex)
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise ParamError("response_format of type json_schema needs 'json_schema.schema'", "response_format")
    return GrammarSpec("json_schema", json_bounds.schema_text(rf.json_schema.schema_, "response_format"))
