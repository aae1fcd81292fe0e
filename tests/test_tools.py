"""Tool calling without a model: the plan's checks, the fallback prompt, the call parser."""

from __future__ import annotations

import json
import random

import pytest
import xgrammar as xgr

from superfluid.engine.params import ParamError
from superfluid.server.messages import template_messages
from superfluid.server.protocol import ChatCompletionRequest
from superfluid.server.tool_models import NamedToolChoice, Tool
from superfluid.server.tool_parser import ToolCallStream, whole
from superfluid.server.tools import plan_tools, render_chat

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def tools(*ts):
    return [Tool.model_validate(t) for t in ts]


def replay(stream: ToolCallStream, text: str, cuts: list[int]) -> tuple[str, dict]:
    """Feed text in pieces; reassemble content and calls from the deltas."""
    deltas, prev = [], 0
    for c in sorted(cuts) + [len(text)]:
        deltas += stream.push(text[prev:c])
        prev = c
    deltas += stream.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            e = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert e["id"] is None, "a call is announced once"
                e["id"], e["name"] = tc["id"], tc["function"]["name"]
            e["arguments"] += tc["function"]["arguments"]
    return content, calls


@pytest.mark.parametrize("eager", [True, False])
def test_streamed_deltas_reassemble_to_the_whole_answer(eager):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    names = frozenset({"get_weather", "add"})
    content, calls, complete = whole(names, eager, text)
    assert complete and content == "Let me check.\n"
    assert [c["function"]["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Pa"ris {x}'}
    rng = random.Random(0)
    for _ in range(200):
        cuts = rng.sample(range(1, len(text)), rng.randint(0, 12))
        got_content, got = replay(ToolCallStream(names, eager), text, cuts)
        assert got_content == "Let me check.\n"
        assert [(g["name"], g["arguments"]) for g in got.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_eager_arguments_stream_before_the_block_closes():
    s = ToolCallStream(frozenset({"add"}), eager=True)
    out = s.push('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert out[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    out = s.push(', "b": 2}}\n</tool_call>')
    assert out == [{"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 2}'}}]}]
    assert s.finish() == [] and s.complete_calls


def test_auto_keeps_what_is_not_a_call_as_content():
    names = frozenset({"add"})
    assert whole(names, False, "no tools here") == ("no tools here", [], False)
    bad = 'x <tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    assert whole(names, False, bad) == (bad, [], False)
    broken = '<tool_call>{"name": "add", "arguments": {"a": </tool_call> tail'
    assert whole(names, False, broken)[0] == broken
    # the held-back prefix of a block comes out at the end when it never became one
    s = ToolCallStream(names, False)
    assert s.push("a <tool_") == [{"content": "a "}]
    assert s.finish() == [{"content": "<tool_"}]


def test_arguments_as_a_string_are_parsed_in_auto_mode():
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    _, calls, complete = whole(frozenset({"add"}), False, text)
    assert complete and json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}


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


@pytest.mark.parametrize("choice,parallel", [("required", True), ("required", False), ("named", True)])
def test_the_grammar_admits_calls_only(choice, parallel):
    tc = NamedToolChoice.model_validate({"function": {"name": "add"}}) if choice == "named" else choice
    plan = plan_tools(tools(WEATHER, ADD), tc, parallel, False)
    g = plan.grammar()
    assert g.kind == "ebnf"
    grammar = xgr.Grammar.from_ebnf(g.source)
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)])
    compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)

    def accepts(text: str) -> bool:
        m = xgr.GrammarMatcher(compiled)
        return all(m.accept_token(b) for b in text.encode()) and m.is_completed()

    call_add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    call_w = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert accepts(call_add)
    assert accepts(call_w) == (choice == "required")
    assert accepts(call_add + "\n" + call_add) == (choice == "required" and parallel)
    assert not accepts('<tool_call>\n{"name": "add", "arguments": {"a": "one", "b": 2}}\n</tool_call>')
    assert not accepts("hello")


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
