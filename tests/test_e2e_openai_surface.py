"""End to end, the OpenAI surface users reach for: tools, message shapes, /tokenize,
echo / best_of / suffix, prompt_cache_key — the official client against one
``superfluid serve`` on the default model (its fast, batch-invariant route).

The server has a small pool (24 MiB, ~540 tokens of KV), half of it the protected
quota of keyed entries, and 16 MiB of host memory for exported entries, so that a
flood of a few prompts is enough to push entries out of the pool and out of host memory.
"""

from __future__ import annotations

import json
import re

import httpx
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


@pytest.fixture(scope="module")
def server():
    s = Server("--kv-cache-mb", "24", "--cache-protected-fraction", "0.5", "--host-cache-mb", "16",
               "--max-queued-requests", "64", runtime="torch", ready_timeout=300)
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=300)


def chat(client, content, **kw):
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def reassemble(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        for tc in ch.delta.tool_calls or []:
            e = calls.setdefault(tc.index, {"id": None, "name": "", "args": ""})
            if tc.id:
                assert e["id"] is None, "a call's id comes once"
                e["id"] = tc.id
                e["name"] = tc.function.name
            e["args"] += tc.function.arguments or ""
        finish = ch.finish_reason or finish
    return content, [(e["name"], e["args"]) for _, e in sorted(calls.items())], finish


def check_call(call, allowed):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in allowed
    args = json.loads(call.function.arguments)
    jsonschema_rs.validate(SCHEMAS[call.function.name], args)  # raises if it does not validate
    return args


# ------------------------------------------------------------------ tools

QUESTIONS = ["What is the weather in Paris?", "Add 2 and 40.", "Is it cold in Oslo today?", "Tell me a joke."]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_forced_tool_calls_parse_validate_and_stream_the_same(client, choice):
    tool_choice = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    allowed = {"add"} if choice == "named" else set(SCHEMAS)
    for i, q in enumerate(QUESTIONS):
        kw = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
        kw.update(temperature=0) if i % 2 == 0 else kw.update(temperature=1.0, seed=i)
        r = chat(client, q, **kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None and len(c.message.tool_calls) == 1
        check_call(c.message.tool_calls[0], allowed)
        # streamed: the deltas reassemble to the very same call
        content, calls, finish = reassemble(chat(client, q, stream=True, **kw))
        assert content == "" and finish == "tool_calls"
        assert calls == [(t.function.name, t.function.arguments) for t in c.message.tool_calls]


def test_parallel_required_calls_each_validate(client):
    for seed in range(3):
        r = chat(client, "Weather in Rome and in Lima, then add 1 and 2.", tools=TOOLS, tool_choice="required",
                 temperature=1.0, seed=seed, max_tokens=150)
        c = r.choices[0]
        assert 1 <= len(c.message.tool_calls) <= 8
        if c.finish_reason == "tool_calls":  # else the length cut the last call short
            for call in c.message.tool_calls:
                check_call(call, set(SCHEMAS))
        assert len({call.id for call in c.message.tool_calls}) == len(c.message.tool_calls)


def test_auto_and_none(client):
    r = chat(client, "What is the weather in Paris?", tools=TOOLS, temperature=0, max_tokens=40)
    c = r.choices[0]
    if c.message.tool_calls:  # the model chose to call: then each call is one of the tools, parsed
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            json.loads(call.function.arguments)
    else:
        assert c.message.content
    content, calls, _ = reassemble(chat(client, "What is the weather in Paris?", tools=TOOLS, temperature=0,
                                        max_tokens=40, stream=True))
    assert (content or None) == c.message.content
    assert calls == [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
    r = chat(client, "What is the weather in Paris?", tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def test_a_tool_round_trip_renders_through_the_fallback(client, server):
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                       temperature=0, max_tokens=24)
    assert r.choices[0].message.content
    # /tokenize renders as the chat endpoint does: with tool_choice none the tools are not shown
    unshown = httpx.post(server.base + "/tokenize", json={"messages": messages, "tools": TOOLS, "tool_choice": "none"}).json()
    assert unshown["count"] == r.usage.prompt_tokens
    tok = httpx.post(server.base + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    assert tok["count"] > unshown["count"]
    text = httpx.post(server.base + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in text
    assert '<tool_response>\n{"temperature": 21, "sky": "clear"}\n</tool_response>' in text
    assert "<tools>" in text and '"name": "add"' in text


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}], None, "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"$ref": "#/nowhere"}}}}}], None, "tools.0.function.parameters"),
    ([WEATHER, {"type": "function", "function": {"name": "no spaces"}}], None, "tools.1.function.name"),
    ([WEATHER, WEATHER], None, "tools.1.function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "add"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400_naming_the_parameter(client, tools, choice, param):
    kw = {"tools": tools} if tools is not None else {}
    if choice is not None:
        kw["tool_choice"] = choice
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", **kw)
    assert e.value.body["param"] == param, e.value.body


# ------------------------------------------------------------------ message shapes


def test_message_shapes(client):
    r = client.chat.completions.create(model=MODEL, messages=[
        {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "name": "ann", "content": [{"type": "text", "text": "Capital of "}, {"type": "text", "text": "France?"}]},
    ], user="u-1", metadata={"team": "x"}, temperature=0, max_tokens=6)
    same = client.chat.completions.create(model=MODEL, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"},
    ], temperature=0, max_tokens=6)
    assert r.choices[0].message.content == same.choices[0].message.content
    assert r.usage.prompt_tokens == same.usage.prompt_tokens
    for part in ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}], max_tokens=4)
        assert e.value.body["param"] == "messages.0.content.1.type" and part["type"] in e.value.body["message"]


# ------------------------------------------------------------------ tokenize


def test_tokenize_and_detokenize(client, server):
    r = client.completions.create(model=MODEL, prompt="Hello, tokenizer world", max_tokens=1)
    t = httpx.post(server.base + "/tokenize", json={"model": MODEL, "prompt": "Hello, tokenizer world", "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == r.usage.prompt_tokens and t["max_model_len"] == 8192
    assert "".join(t["token_strs"]) == "Hello, tokenizer world"
    assert httpx.post(server.base + "/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "Hello, tokenizer world"}
    c = chat(client, "Hi there", max_tokens=1)
    t = httpx.post(server.base + "/tokenize", json={"messages": [{"role": "user", "content": "Hi there"}]}).json()
    assert t["count"] == c.usage.prompt_tokens
    bad = httpx.post(server.base + "/detokenize", json={"tokens": [10 ** 9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(server.base + "/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert httpx.post(server.base + "/tokenize", json={}).status_code == 400


# ------------------------------------------------------------------ completions extras


def test_echo_with_prompt_logprobs(client, server):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    c, p = r.choices[0], plain.choices[0]
    assert c.text == prompt + p.text
    n_prompt = r.usage.prompt_tokens
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + len(p.logprobs.tokens)
    assert "".join(lp.tokens[:n_prompt]) == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:n_prompt])
    assert lp.token_logprobs[n_prompt:] == pytest.approx(p.logprobs.token_logprobs)
    assert lp.text_offset[n_prompt] == len(prompt)
    # a prompt token's logprob is the one the model gives it as the next token of the prefix before it
    ids = httpx.post(server.base + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    nxt = client.completions.create(model=MODEL, prompt=ids[:3], max_tokens=1, temperature=0, logprobs=5)
    top = nxt.choices[0].logprobs.top_logprobs[0]
    if lp.tokens[3] in top:
        assert top[lp.tokens[3]] == pytest.approx(lp.token_logprobs[3], abs=1e-4)
    # streamed echo: the prompt first, then the same text and logprobs
    text, tokens, lps = "", [], []
    for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True, stream=True):
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].logprobs:
                tokens += chunk.choices[0].logprobs.tokens
                lps += chunk.choices[0].logprobs.token_logprobs
    assert text == c.text and tokens == lp.tokens and lps == pytest.approx(lp.token_logprobs)
    # echo with max_tokens 0 scores the prompt alone (lm-eval's loglikelihood requests)
    score = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True)
    s = score.choices[0]
    assert s.text == prompt and s.logprobs.tokens == lp.tokens[:n_prompt]
    assert s.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n_prompt])
    assert score.usage.completion_tokens == 0 and s.finish_reason == "length"
    streamed = [ch.choices[0] for ch in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, stream=True) if ch.choices]
    assert "".join(ch.text for ch in streamed) == prompt and streamed[-1].finish_reason == "length"
    # echo without logprobs: the text only
    e = client.completions.create(model=MODEL, prompt=[prompt, "Two plus two is"], max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text.startswith(prompt) and e.choices[1].text.startswith("Two plus two is")


def test_best_of_returns_the_n_best_by_cumulative_logprob(client):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=6, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **kw)
    ranked = sorted(every.choices, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == every.usage.completion_tokens  # every sample is counted
    for bad, param in ((dict(n=3, best_of=2), "best_of"), (dict(best_of=99), "best_of"),
                       (dict(best_of=3, stream=True), "best_of"), (dict(suffix=" and that is all."), "suffix")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **bad)
        assert e.value.body["param"] == param
    assert "fill-in-the-middle" in e.value.body["message"]


# ------------------------------------------------------------------ prompt_cache_key

PAGE_SLACK = 32  # cached prefixes are whole pages


def _prefix(tag: str, n: int = 30) -> str:
    return " ".join(f"{tag}{i} entry" for i in range(n))  # ~110 tokens


def _complete(client, prompt, **extra):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra or None)


def _metrics(server) -> dict[str, float]:
    text = httpx.get(server.base + "/metrics").text
    return {m.group(1) + (m.group(2) or ""): float(m.group(3))
            for m in re.finditer(r"^(superfluid_prompt_cache_\w+)(\{[^}]*\})? (\S+)$", text, re.M)}


def _flood(client, tag: str, n: int = 12):
    for i in range(n):  # ~1,350 tokens: past the pool (~540) and the host memory (~360)
        _complete(client, _prefix(f"{tag}{i}x") + " end")


def test_a_keyed_prefix_survives_a_flood_that_evicts_an_unkeyed_one(client, server):
    keyed, unkeyed = _prefix("alpha"), _prefix("omega")
    first = _complete(client, keyed + " Q1:", prompt_cache_key="tenant-a")
    _complete(client, unkeyed + " Q1:")
    n = first.usage.prompt_tokens
    m = _metrics(server)
    assert m['superfluid_prompt_cache_protected_bytes{key_class="in_memory"}'] > 0
    _flood(client, "flood")
    again = _complete(client, keyed + " Q2:", prompt_cache_key="tenant-a")
    assert again.usage.prompt_tokens_details.cached_tokens >= n - PAGE_SLACK
    lost = _complete(client, unkeyed + " Q2:")
    assert lost.usage.prompt_tokens_details.cached_tokens == 0
    m = _metrics(server)
    assert m['superfluid_prompt_cache_hits_total{key_class="in_memory"}'] >= 1


def test_a_24h_entry_comes_back_from_host_memory_with_the_same_text(client, server):
    long_lived = _prefix("zeta") + " The answer is"
    first = _complete(client, long_lived, prompt_cache_key="tenant-z", prompt_cache_retention="24h")
    # newer keyed entries fill the protected quota (half the pool: two entries), so the 24h
    # one is no longer protected and the flood pushes it out of the pool, to host memory
    for tenant in ("beta", "gamma"):
        _complete(client, _prefix(tenant) + " Q1:", prompt_cache_key=f"tenant-{tenant}")
    assert _metrics(server)['superfluid_prompt_cache_protected_bytes{key_class="24h"}'] == 0
    _flood(client, "deluge")
    m = _metrics(server)
    assert m['superfluid_prompt_cache_exported_bytes{key_class="24h"}'] > 0
    assert m['superfluid_prompt_cache_resident_bytes{key_class="24h"}'] == 0
    back = _complete(client, long_lived, prompt_cache_key="tenant-z", prompt_cache_retention="24h")
    assert back.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - PAGE_SLACK
    assert back.choices[0].text == first.choices[0].text
    assert _metrics(server)['superfluid_prompt_cache_hits_total{key_class="24h"}'] >= 1
    with pytest.raises(openai.BadRequestError) as e:
        _complete(client, "x", prompt_cache_key="k", prompt_cache_retention="forever")
    assert e.value.body["param"] == "prompt_cache_retention"
