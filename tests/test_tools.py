"""Tool calling without a model: the plan's checks, the tool grammar in each family's
framing, the fallback prompt. The parsers: test_tool_parsers.py."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from superfluid.engine.params import ParamError
from superfluid.server.messages import template_messages
from superfluid.server.protocol import ChatCompletionRequest
from superfluid.server.tool_models import NamedToolChoice, Tool
from superfluid.server.tools import plan_tools, render_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def tools(*ts):
    return [Tool.model_validate(t) for t in ts]



def test_plan_checks_name_the_parameter():
    with pytest.raises(ParamError) as e:
        plan_tools(tools({"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}), None, True, False)
    assert e.value.param == "tools.0.function.parameters"
    with pytest.raises(ParamError) as e:
        plan_tools(tools(WEATHER, {"type": "function", "function": {"name": "bad name!"}}), None, True, False)
    assert e.value.param == "tools.1.function.name"
    with pytest.raises(ParamError) as e:
        plan_tools(tools(WEATHER, WEATHER), None, True, False)
    assert e.value.param == "tools.1.function.name"
    with pytest.raises(ParamError) as e:
        plan_tools(tools(WEATHER), NamedToolChoice.model_validate({"function": {"name": "add"}}), True, False)
    assert e.value.param == "tool_choice"
    with pytest.raises(ParamError) as e:
        plan_tools(None, "required", True, False)
    assert e.value.param == "tool_choice"
    with pytest.raises(ParamError) as e:
        plan_tools(tools(WEATHER), "required", True, True)
    assert e.value.param == "tool_choice"
    assert plan_tools(None, "auto", True, False) is None


CALLS = {  # one call of add, and one of get_weather, as each framing writes them
    "hermes": ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', "\n", "", ""),
    "llama3_json": ('{"name": "add", "parameters": {"a": 1, "b": 2}}',
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', "; ", "", ""),
    "mistral": ('{"name": "add", "arguments": {"a": 1, "b": 2}}',
                '{"name": "get_weather", "arguments": {"city": "Rome"}}', ", ", "[TOOL_CALLS][", "]"),
    "granite": ('{"name": "add", "arguments": {"a": 1, "b": 2}}',
                '{"name": "get_weather", "arguments": {"city": "Rome"}}', ", ", "<|tool_call|>[", "]"),
}
CALLS["qwen3_coder"] = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                        "</function>\n</tool_call>",
                        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>",
                        "\n", "", "")
CALLS["pythonic"] = ("add(a=1, b=2)", 'get_weather(city="Rome")', ", ", "[", "]")


def _matcher(plan):
    grammar = xgr.Grammar.from_ebnf(plan.grammar().source)
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)])
    return xgr.GrammarCompiler(info).compile_grammar(grammar)


@pytest.mark.parametrize("syntax", list(CALLS))
@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("named", True)])
def test_the_grammar_admits_calls_only(choice, parallel, syntax):
    tc = NamedToolChoice.model_validate({"function": {"name": "add"}}) if choice == "named" else choice
    plan = plan_tools(tools(WEATHER, ADD), tc, parallel, False, syntax)
    assert plan.grammar().kind == "ebnf"
    compiled = _matcher(plan)
    call_add, call_w, sep, start, end = CALLS[syntax]

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_token(b) for b in text.encode()) and m.is_completed()

    assert accepts(start + call_add + end)
    assert accepts(start + call_w + end) == (choice == "required")
    assert accepts(start + call_add + sep + call_add + end) == (choice == "required" and parallel)
    assert not accepts(start + call_add.replace("1", '"one"') + end)
    assert not accepts("hello")


def test_a_tool_list_the_native_syntax_cannot_say_is_framed_in_hermes_json():
    """Pythonic calls need Python names; a schema with keywords beyond properties and
    required (here: anyOf at the top) cannot be split into keyword arguments."""
    dashed = {"type": "function", "function": {"name": "get-weather", "parameters": WEATHER["function"]["parameters"]}}
    any_of = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}}}
    for t in (dashed, any_of):
        plan = plan_tools(tools(t), "required", True, False, "pythonic")
        assert plan.forced_syntax == "hermes"
        assert '"<tool_call>\\n"' in plan.grammar().source
    assert plan_tools(tools(any_of), "required", True, False, "qwen3_coder").forced_syntax == "qwen3_coder"
    assert plan_tools(tools(ADD), "required", True, False, "pythonic").forced_syntax == "pythonic"


@pytest.mark.parametrize("syntax", list(CALLS))
def test_one_call_ends_the_output(syntax):
    """A named call (or parallel_tool_calls false) ends with its call: the grammar then
    admits nothing but the end, so the model's end-of-text is forced, not max_tokens."""
    plan = plan_tools(tools(WEATHER, ADD), "required", False, False, syntax)
    call_add, _, sep, start, end = CALLS[syntax]
    m = xgr.GrammarMatcher(_matcher(plan))
    assert all(m.accept_token(b) for b in (start + call_add + end).encode())
    assert m.is_completed()
    assert not any(m.accept_token(b) for b in (sep or " ").encode()[:1])


class _Tok:
    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        self.seen = (messages, extra)
        return json.dumps(messages)


def test_fallback_prompt_for_a_template_without_tool_syntax():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Rome?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]})
    msgs = template_messages(body.messages)
    tok = _Tok("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    plan = plan_tools(tools(WEATHER), "auto", True, False)
    render_chat(tok, msgs, plan, True)
    seen, extra = tok.seen
    assert extra == {}
    assert seen[0]["role"] == "system" and seen[0]["content"].startswith("Be brief.\n\n# Tools")
    assert '"name": "get_weather"' in seen[0]["content"]
    assert seen[1] == {"role": "user", "content": "Weather in Rome?", "name": "ann"}
    assert seen[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert seen[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # a template with tool syntax gets the tools and the turns as they are
    tok = _Tok("{% if tools %}{{ tools }}{% endif %}")
    render_chat(tok, msgs, plan, True)
    seen, extra = tok.seen
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert seen[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"}


def test_unsupported_content_parts_are_named():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ParamError) as e:
        template_messages(body.messages)
    assert e.value.param == "messages.0.content.1.type" and "image_url" in str(e.value)
