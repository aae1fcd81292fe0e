"""End to end, forced tool calls end when their calls are complete: ``superfluid serve`` on
the default model through the official client. At temperature 1 the model may go on to
write more calls; ``max_tokens`` is only a ceiling, so a later call it cuts short is
dropped and the calls before it are the answer, ``finish_reason: "tool_calls"``. (Each
family's framing through the app, on the toy model: test_tool_parsers.py.)"""

from __future__ import annotations

import json

import pytest

from serve_helpers import Server

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")
jsonschema_rs = pytest.importorskip("jsonschema_rs")

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 plus 40?"}]


@pytest.fixture(scope="module")
def client():
    s = Server(runtime="torch", ready_timeout=300)
    yield openai.OpenAI(base_url=s.v1, api_key="none", max_retries=0, timeout=300)
    s.cleanup()


def check_calls(c) -> list[tuple[str, str]]:
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        jsonschema_rs.validate(SCHEMAS[call.function.name], json.loads(call.function.arguments))
    return [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def reassemble(stream) -> tuple[list[tuple[str, str]], str | None]:
    calls, finish = {}, None
    for chunk in stream:
        ch = chunk.choices[0]
        assert not ch.delta.content
        for tc in ch.delta.tool_calls or []:
            e = calls.setdefault(tc.index, ["", ""])
            e[0] = tc.function.name or e[0]
            e[1] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return [tuple(e) for _, e in sorted(calls.items())], finish


def test_required_calls_at_temperature_1_end_with_their_calls(client):
    budgets = []
    for seed in range(20):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=150)
        calls = check_calls(r.choices[0])
        assert 1 <= len(calls) <= 8
        budgets.append(r.usage.completion_tokens)
        if seed < 3:  # streamed, the same seed reassembles to the same calls
            got, finish = reassemble(client.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed,
                max_tokens=150, stream=True))
            assert (got, finish) == (calls, "tool_calls")
    assert max(budgets) <= 150


def test_one_call_when_parallel_calls_are_off_or_a_function_is_named(client):
    for seed in range(4):
        for kw in ({"tool_choice": "required", "parallel_tool_calls": False},
                   {"tool_choice": {"type": "function", "function": {"name": "add"}}}):
            r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed,
                                               max_tokens=150, **kw)
            assert len(check_calls(r.choices[0])) == 1
            assert r.usage.completion_tokens < 150  # the grammar ended with the call, not the budget
