"""The tool-call parsers, one per family, without a model: texts written in each family's
syntax (as the models write them) parse into the same calls whole and streamed (in random
pieces and character by character), what is not a valid call stays content, forced
output streams its arguments early, the parser is picked from the chat template, and a
push costs what its text does, not what the response so far does."""

from __future__ import annotations

import json
import random
import time

import pytest

from superfluid.server.tool_models import Tool
from superfluid.server.tool_parser import finish_reason, open_stream, whole
from superfluid.server.toolcalls.registry import PARSERS, detect, resolve, select
from superfluid.server.tools import plan_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOTE = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}},
                                     "pinned": {"type": "boolean"}}, "required": ["text"]}}}
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
ONE_TWO = ("add", {"a": 1, "b": 2})


def plan(syntax: str, choice="auto", parallel=True):
    return plan_tools([Tool.model_validate(t) for t in (WEATHER, ADD, NOTE)], choice, parallel, False, syntax)


# (family, text as the model writes it, expected content, expected calls)
RECORDED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.\n", [PARIS, ONE_TWO]),
    ("hermes", '<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',  # Qwen3, thinking first
     "<think>\nThe user wants the weather.\n</think>\n\n", [PARIS]),
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [ONE_TWO]),  # stopped before the close
    ("hermes", '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}\n</tool_call>', None, [ONE_TWO]),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [PARIS, ONE_TWO]),
    ("llama3_json", '\n\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n', None, [ONE_TWO]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', None, [PARIS, ONE_TWO]),  # v3 (Mistral-7B v0.3)
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
     "Sure.", [PARIS, ONE_TWO]),  # v11+ (Mistral Small 3.2, Devstral)
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "celsius"}', None, [PARIS]),
    ("qwen3_coder", "I'll look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>", "I'll look it up.\n", [PARIS]),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=write_note>\n<parameter=text>\nline one\n"
                    "line <two> & 3\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n<parameter=pinned>\n"
                    "true\n</parameter>\n</function>\n</tool_call>",
     None, [ONE_TWO, ("write_note", {"text": "line one\nline <two> & 3", "tags": ["a", "b"], "pinned": True})]),
    ("pythonic", '[get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]', None, [PARIS, ONE_TWO]),
    ("pythonic", "<|python_start|>[write_note(text='it\\'s [done]', tags=['x'], pinned=true)]<|python_end|>", None,
     [("write_note", {"text": "it's [done]", "tags": ["x"], "pinned": True})]),  # Llama 4
    ("granite", 'Checking.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "add", "arguments": {"a": 1, "b": 2}}]', "Checking.", [PARIS, ONE_TWO]),  # Granite 3.x
    ("granite", '<|tool_call|> {"name": "add", "arguments": {"a": 1, "b": 2}}', None, [ONE_TWO]),
]


def replay(stream, text: str, cuts: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """Feed text in pieces; reassemble content and calls from the deltas, checking their shape."""
    deltas, prev = [], 0
    for c in sorted(cuts) + [len(text)]:
        deltas += stream.push(text[prev:c])
        prev = c
    deltas += stream.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                assert tc["index"] == len(calls) and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[tc["index"]][1] += tc["function"]["arguments"]
    return content, [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("family,text,content,expected", RECORDED, ids=[f"{r[0]}-{i}" for i, r in enumerate(RECORDED)])
def test_each_family_parses_whole_and_streamed_alike(family, text, content, expected):
    p = plan(family)
    got_content, calls, complete = whole(p, text)
    assert got_content == content and complete
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == expected
    want = (content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert replay(open_stream(p), text, list(range(1, len(text)))) == want  # character by character
    rng = random.Random(0)
    for _ in range(100):
        assert replay(open_stream(p), text, rng.sample(range(1, len(text)), rng.randint(0, 12))) == want


NOT_CALLS = [  # (family, text): each stays content, exactly as written
    ("hermes", 'x <tool_call>{"name": "nope", "arguments": {}}</tool_call>'),  # no such tool
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": </tool_call> tail'),  # broken JSON
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": "one", "b": 2}}</tool_call>'),  # against the schema
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}</tool_call>'),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'),  # a required property missing
    ("llama3_json", 'The answer is {"name": "add", "parameters": {"a": 1, "b": 2}} as JSON.'),  # mid-prose
    ("llama3_json", '{"answer": 42} is what I found'),
    ("llama3_json", "<|python_tag|>import math\nprint(math.pi)"),  # 3.1's code interpreter
    ("mistral", "[TOOL_CALLS] I cannot call that."),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1'),  # cut short
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "nope", "arguments": {}}]'),
    ("qwen3_coder", "<tool_call>\n<function=nope>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=add>\n<parameter=a>\none\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
                    "</function>\n</tool_call>"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[add(1, 2)]"),  # positional arguments: no names to give them
    ("pythonic", "Try [add(a=1, b=2)] yourself."),
    ("pythonic", "[add(a=1, b=__import__('os'))]"),
    ("granite", '<|tool_call|>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "nope", "arguments": {}}]'),
    ("granite", "<|tool_call|> none of them fit"),
]


@pytest.mark.parametrize("family,text", NOT_CALLS, ids=[f"{r[0]}-{i}" for i, r in enumerate(NOT_CALLS)])
def test_what_is_not_a_valid_call_stays_content(family, text):
    assert whole(plan(family), text) == (text, [], False)
    assert replay(open_stream(plan(family)), text, list(range(1, len(text)))) == (text, [])


def test_content_that_may_begin_a_call_waits_and_whitespace_between_calls_is_not_content():
    s = open_stream(plan("hermes"))
    assert s.push("a <tool_") == [{"content": "a "}]
    assert s.finish() == [{"content": "<tool_"}]
    block = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    content, calls, _ = whole(plan("hermes"), f"\n\n{block}\n\n{block}\n")
    assert content is None and len(calls) == 2
    content, calls, _ = whole(plan("hermes"), f"\n\n{block}\n\n{block}\nDone.\n")
    assert content == "\nDone." and len(calls) == 2
    assert whole(plan("hermes"), "  hi  ")[0] == "  hi  " and whole(plan("hermes"), "\n")[0] == "\n"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = RECORDED[0][1]
    content, calls, complete = whole(plan("hermes", parallel=False), text)
    assert content == "Let me check.\n" and complete
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    content, calls, _ = whole(plan("mistral", parallel=False), RECORDED[7][1])
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


# ------------------------------------------------------------------ forced (under the grammar)

FORCED = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}\n</tool_call>\n'
              '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Pa\\"ris {x}"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}, '
               '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
    # the families whose calls are not JSON, in their own syntax (tools.py's grammar writes these)
    "qwen3_coder": '<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"ris {x}\n</parameter>\n</function>\n'
                   '</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n'
                   '</parameter>\n</function>\n</tool_call>',
    "pythonic": '[get_weather(city="Pa\\"ris {x}"), add(a=1, b=2)]',
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa\\"ris {x}"}}, '
               '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
}


@pytest.mark.parametrize("family", list(FORCED))
def test_forced_calls_stream_alike_in_every_framing(family):
    text = FORCED[family]
    p = plan(family, "required")
    content, calls, complete = whole(p, text)
    assert content is None and complete
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Pa\\"ris {x}"}'), ("add", '{"a": 1, "b": 2}')]
    want = ("", [(c["function"]["name"], c["function"]["arguments"]) for c in calls])
    assert replay(open_stream(p), text, list(range(1, len(text)))) == want
    rng = random.Random(1)
    for _ in range(100):
        assert replay(open_stream(p), text, rng.sample(range(1, len(text)), rng.randint(0, 12))) == want


def test_forced_arguments_stream_before_the_call_closes():
    s = open_stream(plan("hermes", "required"))
    out = s.push('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert out[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert out[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1'
    out = s.push(', "b": 2}}\n</tool_call>')
    assert out == [{"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 2}'}}]}]
    assert s.finish() == [] and s.complete_calls and finish_reason(s, "stop") == "tool_calls"


def test_a_forced_call_the_ceiling_cuts_short_is_dropped():
    """max_tokens is a ceiling: the calls complete before it are the answer."""
    s = open_stream(plan("hermes", "required"))
    first = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    s.push(first)
    assert s.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa') == []  # a later call waits
    assert s.finish() == []
    assert [c["function"]["name"] for c in s.calls] == ["add"] and finish_reason(s, "length") == "tool_calls"
    # ... a later call that completes goes out whole
    s = open_stream(plan("hermes", "required"))
    s.push(first)
    out = s.push('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert [tc["tool_calls"][0].get("id") is not None for tc in out] == [True, False]
    # the first call cut short: the ceiling ended it, as it says
    s = open_stream(plan("hermes", "required"))
    s.push('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert finish_reason(s, "length") == "length" and not s.complete_calls
    # auto: a length finish stays one
    s = open_stream(plan("hermes"))
    s.push(first + "and then")
    assert finish_reason(s, "length") == "length"


@pytest.mark.parametrize("family,first", [
    ("qwen3_coder", '<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n'
                    '</function>\n</tool_call>\n'),
    ("pythonic", "[add(a=1, b=2), "),
])
def test_native_forced_calls_go_out_whole_and_a_cut_one_is_dropped(family, first):
    """Qwen3-Coder XML and pythonic arguments are not JSON as written: each call goes out,
    whole and as JSON, when it is complete; one the ceiling cuts short never does."""
    s = open_stream(plan(family, "required"))
    out = s.push(first)
    assert [d["tool_calls"][0]["function"] for d in out] == [{"name": "add", "arguments": ""},
                                                             {"arguments": '{"a": 1, "b": 2}'}]
    cut = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa" if family == "qwen3_coder" else 'get_weather(city="Pa'
    assert s.push(cut) == [] and s.finish() == []
    assert [c["function"]["name"] for c in s.calls] == ["add"] and finish_reason(s, "length") == "tool_calls"
    # a pythonic string value is read as the JSON the grammar wrote ("\/" is "/", "\u00e9" is "é")
    if family == "pythonic":
        _, calls, _ = whole(plan(family, "required"), '[get_weather(city="a\\/b \\u00e9")]')
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "a/b é"}


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral", "granite", "qwen3_coder", "pythonic"])
def test_forced_calls_through_the_app_in_each_framing(family):
    """``create_app(tool_call_parser=...)`` (``--tool-call-parser``): the toy model writes
    under the family's grammar, the family's stream reads it, whole and streamed."""
    from fastapi.testclient import TestClient

    from superfluid.engine.async_engine import AsyncEngine
    from superfluid.engine.config import EngineConfig
    from superfluid.engine.loader import build_engine
    from superfluid.server.openai import create_app

    engine = build_engine(EngineConfig(runtime="toy", model="toy", runtime_extra=(("max_seq_len", 4096), ("n_cells", 16384))))
    body = {"model": "toy", "messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER, ADD],
            "tool_choice": "required", "temperature": 1.0, "seed": 3, "max_tokens": 400}
    with TestClient(create_app(AsyncEngine(engine), tool_call_parser=family, web_ui=False)) as c:
        r = c.post("/v1/chat/completions", json=body).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "tool_calls", choice
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in choice["message"]["tool_calls"]]
        for name, args in calls:
            assert name in ("get_weather", "add") and isinstance(json.loads(args), dict)
        raw = c.post("/v1/chat/completions", json=dict(body, stream=True)).text
    streamed: dict[int, list[str]] = {}
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for tc in json.loads(line[6:])["choices"][0]["delta"].get("tool_calls") or []:
                e = streamed.setdefault(tc["index"], ["", ""])
                e[0] = tc["function"].get("name") or e[0]
                e[1] += tc["function"]["arguments"]
    assert [tuple(e) for _, e in sorted(streamed.items())] == calls


# ------------------------------------------------------------------ which parser


TEMPLATES = {  # tiny templates with each family's markers, as the real ones write them
    "mistral": "{% if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}"
               "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls|tojson }}{% endif %}{% endfor %}",
    "qwen3_coder": "{% if tools %}<tools>{% for t in tools %}<function><name>{{ t.function.name }}</name></function>"
                   "{% endfor %}</tools>\nIf you choose to call a function, reply:\n<tool_call>\n<function=example>\n"
                   "<parameter=x>\nvalue\n</parameter>\n</function>\n</tool_call>{% endif %}",
    "hermes": "{% if tools %}<tools>{{ tools }}</tools> For each call return <tool_call>{\"name\": ..., "
              "\"arguments\": ...}</tool_call>{% endif %}",
    "pythonic": "{% if tools %}Reply in the format [func_name1(params_name1=params_value1, params_name2=params_value2...), "
                "func_name2(params)]{% endif %}",
    "llama3_json": "{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary of argument "
                   "name and its value}.{% endif %}{% if builtin_tools %}<|python_tag|>{% endif %}",
    "granite": "{% if tools and not available_tools %}{% set available_tools = tools %}{% endif %}{% if available_tools %}"
               "respond only with <|tool_call|> followed by a JSON list of tools used.{% endif %}",
}


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_the_parser_is_read_from_the_chat_template(family):
    assert detect(TEMPLATES[family]) == family


def test_parser_selection_defaults_and_flags():
    assert detect(None) == "hermes"  # no template: the fallback prompt asks for Hermes' blocks
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") == "hermes"  # no tool syntax: the fallback
    assert detect("{% if tools %}{{ tools }}{% endif %}") == "hermes"  # tool syntax we do not know
    assert detect("{% if tools %}<|python_start|>{% endif %}") == "pythonic"  # Llama 4
    assert detect("{% if tools %}<|python_tag|>{% endif %}") == "llama3_json"
    assert select("auto", TEMPLATES["mistral"]) == "mistral"
    assert select("pythonic", TEMPLATES["mistral"]) == "pythonic"  # the flag wins
    with pytest.raises(ValueError):
        select("nope", None)
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic", "granite"}


class _Tok:
    """A vocabulary where [TOOL_CALLS] is one special token and <tool_call> plain text."""

    chat_template = TEMPLATES["mistral"]
    special_ids = frozenset({5})

    def encode(self, text, add_special_tokens=False):
        return [5] if text == "[TOOL_CALLS]" else [ord(c) for c in text]


def test_special_token_markers_keep_special_tokens_in_the_decode():
    assert resolve("auto", _Tok()) == resolve("mistral", _Tok())
    syntax = resolve("auto", _Tok())
    assert syntax.family == "mistral" and syntax.keep_specials
    assert not resolve("hermes", _Tok()).keep_specials


# ------------------------------------------------------------------ cost


def _pushed_char_by_char(p, text: str) -> float:
    s = open_stream(p)
    t = time.perf_counter()
    for ch in text:
        s.push(ch)
    s.finish()
    return time.perf_counter() - t


@pytest.mark.parametrize("family", list(PARSERS))
def test_a_200kb_response_pushed_char_by_char_costs_linear_time(family):
    """200 KB of prose, then a call with a 200 KB argument, one character per push (400k
    pushes): about 1 s here. The parser before this one re-read the whole text on every
    push: 40 KB of prose alone took 0.4 s and grew as the square (200 KB: ~10 s), and a
    forced call's arguments were re-scanned in Python on every push (4 KB: 0.3 s;
    200 KB: ~13 minutes)."""
    prose = ("Lorem ipsum <b>dolor</b> [sit] {amet}, consectetur; " * 4000)[:200_000]
    calls = {"hermes": '<tool_call>\n{"name": "write_note", "arguments": {"text": %s}}\n</tool_call>',
             "llama3_json": '<|python_tag|>{"name": "write_note", "parameters": {"text": %s}}',
             "mistral": '[TOOL_CALLS]write_note[ARGS]{"text": %s}',
             "qwen3_coder": "<tool_call>\n<function=write_note>\n<parameter=text>\n%s\n</parameter>\n</function>\n</tool_call>",
             "pythonic": "<|python_start|>[write_note(text=%s)]<|python_end|>",
             "granite": '<|tool_call|>[{"name": "write_note", "arguments": {"text": %s}}]'}
    arg = json.dumps(prose) if family != "qwen3_coder" else prose
    text = prose + "\n" + calls[family] % arg
    assert len(whole(plan(family), text)[1]) == 1
    assert _pushed_char_by_char(plan(family), text) < 10.0
    if family == "hermes":  # the forced reader (one for every framing)
        forced = calls["hermes"] % arg
        assert len(whole(plan(family, "required"), forced)[1]) == 1
        assert _pushed_char_by_char(plan(family, "required"), forced) < 5.0
