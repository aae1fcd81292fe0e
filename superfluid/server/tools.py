"""Tool calling: what a request's ``tools`` and ``tool_choice`` ask, and how it is prompted.

The call syntax is the model family's (toolcalls/registry.py picks it from the chat
template: Hermes, Llama 3 JSON, Mistral, Qwen3-Coder XML, pythonic, Granite); Hermes' is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. ``tool_choice``:
- ``none``: tools are not shown to the model and nothing is parsed;
- ``auto`` (the default with tools): the model decides; calls are parsed from its text
  (tool_parser.py) and kept when they follow their tool's schema, anything else is content;
- ``required`` / a named function: the output is generated under a grammar that admits
  only calls whose arguments follow the function's JSON schema (xgrammar, with no free
  whitespace), written in the family's own syntax: its JSON framing (toolcalls/forced.py),
  Qwen3-Coder's XML or a pythonic list (toolcalls/forced_native.py; Hermes' JSON for a
  tool list that syntax cannot say exactly), so every call parses and validates.
  ``parallel_tool_calls`` lets ``required`` write up to ``MAX_PARALLEL_CALLS`` calls; a
  named function, or ``parallel_tool_calls: false``, gets one, and the grammar then ends
  with it: end of text is all it admits.

Prompting: a chat template that has tool syntax (it mentions ``tools``) renders the
tools and tool turns itself. For one that has none (the default model's), the fallback:
the tool list and Hermes' format go into the system message, an assistant turn's calls
are written as call blocks after its content, and a ``tool`` result is a ``user`` turn
holding ``<tool_response>...</tool_response>``. A template that refuses a system turn (Gemma 2's)
gets the tools at the start of the first user turn instead.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cached_property

import xgrammar as xgr
from jinja2.exceptions import TemplateError

from ..engine.params import GrammarSpec, ParamError
from . import json_bounds
from .tool_models import NamedToolChoice, Tool
from .toolcalls.forced import FRAMINGS, framing
from .toolcalls.forced_native import NATIVE, native_grammar
from .toolcalls.hermes import CLOSE, OPEN
from .toolcalls.registry import has_tool_syntax
MAX_TOOLS = 128  # OpenAI's limit
MAX_PARALLEL_CALLS = 8
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
_NO_ARGS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    functions: tuple[dict, ...]  # OpenAI function dicts: name, description, parameters
    named: str | None = None
    parallel: bool = True
    syntax: str = "hermes"  # the tool-call parser's family (toolcalls/registry.py)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f["name"] for f in self.functions)

    @property
    def constrained(self) -> bool:
        """The output is nothing but call blocks, written under a grammar."""
        return self.mode in ("required", "named")

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def grammar(self) -> GrammarSpec | None:
        return GrammarSpec("ebnf", self._forced[1], "tools") if self.constrained else None

    @property
    def forced_syntax(self) -> str:
        """The syntax the grammar writes calls in: the family's own, or Hermes' JSON where
        the family's calls are not JSON and its framing cannot say these tools exactly."""
        return self._forced[0]

    @cached_property
    def _forced(self) -> tuple[str, str]:
        fns = [f for f in self.functions if self.mode == "required" or f["name"] == self.named]
        max_calls = MAX_PARALLEL_CALLS if self.mode == "required" and self.parallel else 1
        if self.syntax in NATIVE:
            text = native_grammar(self.syntax, fns, max_calls)
            if text is not None:
                return self.syntax, text
        fr = framing(self.syntax)
        calls = [_call_grammar(f, fr.key) for f in fns]
        one = _concat(_literal(fr.open), xgr.Grammar.union(*calls) if len(calls) > 1 else calls[0], _literal(fr.close))
        # root renamed: the whole output is start, 1..n calls (one unless parallel), end
        block = re.sub(r"^root ::=", "tool_call_block ::=", str(one), count=1, flags=re.M)
        body = "tool_call_block"
        if max_calls > 1:
            body = f"tool_call_block ({_ebnf(fr.sep)} tool_call_block){{0,{max_calls - 1}}}"
        root = " ".join(x for x in (_ebnf(fr.start), body, _ebnf(fr.end)) if x)
        return (self.syntax if self.syntax in FRAMINGS else "hermes"), f"root ::= {root}\n{block}"

    def prompt_tools(self) -> list[dict]:
        """The tools as templates render them (OpenAI's shape)."""
        return [{"type": "function", "function": f} for f in self.functions]


def _call_grammar(f: dict, key: str) -> xgr.Grammar:
    schema = {
        "type": "object",
        "properties": {"name": {"const": f["name"]}, key: f["parameters"]},
        "required": ["name", key],
        "additionalProperties": False,
    }
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def _ebnf(text: str) -> str:
    """A string literal in xgrammar's EBNF ('' for none: an empty literal is not one)."""
    return json.dumps(text) if text else ""


def _literal(text: str) -> xgr.Grammar | None:
    return xgr.Grammar.from_ebnf(f"root ::= {_ebnf(text)}") if text else None


def _concat(*parts: xgr.Grammar | None) -> xgr.Grammar:
    parts = [p for p in parts if p is not None]
    return xgr.Grammar.concat(*parts) if len(parts) > 1 else parts[0]


def plan_tools(tools: list[Tool] | None, choice, parallel: bool, has_response_format: bool,
               syntax: str = "hermes") -> ToolPlan | None:
    """Check tools and tool_choice (ParamError naming the parameter); None: no tools."""
    if not tools:
        if isinstance(choice, NamedToolChoice) or choice == "required":
            raise ParamError("tool_choice asks for a tool call but the request has no tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise ParamError(f"at most {MAX_TOOLS} tools", "tools")
    functions, seen = [], set()
    for i, t in enumerate(tools):
        f = t.function
        if not _NAME.match(f.name):
            raise ParamError(f"tools.{i}.function.name {f.name!r} must be 1-64 letters, digits, '_' or '-'",
                             f"tools.{i}.function.name")
        if f.name in seen:
            raise ParamError(f"tools.{i}.function.name {f.name!r} is used by another tool", f"tools.{i}.function.name")
        seen.add(f.name)
        params = _check_parameters(i, f.parameters)
        fn = {"name": f.name, "parameters": params}
        if f.description is not None:
            fn = {"name": f.name, "description": f.description, "parameters": params}
        functions.append(fn)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in seen:
            raise ParamError(f"tool_choice names {choice.function.name!r}, which is not one of the tools", "tool_choice")
        mode, named = "named", choice.function.name
    else:
        mode, named = choice or "auto", None
    if mode in ("required", "named") and has_response_format:
        raise ParamError("a required tool call cannot be combined with response_format", "tool_choice")
    return ToolPlan(mode, tuple(functions), named, parallel, syntax)


def _check_parameters(i: int, params: dict | None) -> dict:
    param = f"tools.{i}.function.parameters"
    if params is None or params == {}:
        return dict(_NO_ARGS)
    text = json_bounds.schema_text(params, param)  # depth and size, before xgrammar walks it
    if params.get("type", "object") != "object":
        raise ParamError(f"{param} must be a JSON schema of type 'object', got type {params.get('type')!r}", param)
    try:
        xgr.Grammar.from_json_schema(text, any_whitespace=False)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ParamError(f"{param} is not a JSON schema this server can follow: {_clean(str(e))}", param) from None
    return params


def _clean(message: str) -> str:
    return " ".join(re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?", "", message.strip()).split())


# ------------------------------------------------------------------ prompting


def render_chat(tokenizer, messages: list[dict], plan: ToolPlan | None, add_generation_prompt: bool,
                **template) -> str:
    """The prompt text: the template's own tool syntax where it has one, else the fallback.
    ``template``: more of apply_chat_template's arguments (continue_final_message, variables,
    a trusted request's chat_template in place of the model's)."""
    show = plan is not None and plan.mode != "none"
    if has_tool_syntax(template.get("chat_template") or getattr(tokenizer, "chat_template", None)):
        extra = {"tools": plan.prompt_tools()} if show else {}
        return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template, **extra)
    msgs = [_fallback_turn(m) for m in messages]

    def render(turns: list[dict]) -> str:
        return tokenizer.apply_chat_template(turns, add_generation_prompt=add_generation_prompt, **template)

    if not show:
        return render(msgs)
    intro = fallback_system_text(plan)
    if msgs and msgs[0]["role"] == "system":
        msgs[0] = dict(msgs[0], content=f"{msgs[0]['content']}\n\n{intro}" if msgs[0]["content"] else intro)
        return render(msgs)
    try:
        return render([{"role": "system", "content": intro}, *msgs])
    except TemplateError:
        # a template with no system role (Gemma 2's raises on one): the tools open the first user turn
        if not msgs or msgs[0]["role"] != "user":
            raise
        return render([dict(msgs[0], content=f"{intro}\n\n{msgs[0]['content']}"), *msgs[1:]])


def fallback_system_text(plan: ToolPlan) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in plan.prompt_tools())
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{OPEN}{CLOSE} XML tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n{CLOSE}"
    )


def call_block(name: str, arguments: dict | str) -> str:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'{OPEN}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {args}}}\n{CLOSE}'


def _fallback_turn(m: dict) -> dict:
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    if m.get("tool_calls"):
        blocks = "\n".join(call_block(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
        content = f"{m['content']}\n{blocks}" if m["content"] else blocks
        return {k: v for k, v in m.items() if k != "tool_calls"} | {"content": content}
    return m
