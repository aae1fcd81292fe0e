"""End to end, the request fields vLLM honours (issue 27): the official ``openai`` client,
vLLM's fields through ``extra_body``, against one ``superfluid serve`` on the default model.

Each test would fail on a server that accepts the field and ignores it: the field is
chosen so that honouring it changes what comes back (a token that greedy decoding would
pick is banned, a finish that would come early is held back, and so on).
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from serve_helpers import Server

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    s = Server("--kv-cache-mb", "64", "--runtime-arg", "max_seq_len=512", runtime="torch", ready_timeout=300)
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)


def chat(client, content: str, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


def complete(client, prompt: str, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=prompt, **kw)


# ------------------------------------------------------------------ models, context


def test_models_retrieve(client):
    m = client.models.retrieve(MODEL)
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_a_completion_past_the_context_is_a_400_naming_its_length(client):
    limit = client.models.retrieve(MODEL).model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=10_000_000)
    msg = e.value.body["message"]
    assert f"maximum context length is {limit} tokens" in msg and "10000000 in the completion" in msg
    assert e.value.body["param"] == "messages" and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "hi", max_tokens=limit)
    assert f"{limit} in the completion" in e.value.body["message"] and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "hi " * (limit + 10), max_tokens=1)
    assert "input tokens" in e.value.body["message"]
    # no max_tokens: the endpoint's default, clamped to the context as before
    assert complete(client, "hi " * (limit - 4), max_tokens=openai.NOT_GIVEN).usage.completion_tokens <= 3


# ------------------------------------------------------------------ token rules


def test_min_tokens_holds_back_the_end(client):
    q = "Say only the word yes."
    base = chat(client, q, max_tokens=20)
    assert base.choices[0].finish_reason == "stop" and base.usage.completion_tokens < 8  # it ends early
    held = chat(client, q, max_tokens=20, extra_body={"min_tokens": 8})
    assert held.usage.completion_tokens >= 8
    assert held.choices[0].message.content.startswith(base.choices[0].message.content.rstrip("."))
    # a stop string cannot end it early either (vLLM checks stop strings from min_tokens on)
    held = complete(client, "1, 2, 3,", max_tokens=6, stop=[","], extra_body={"min_tokens": 4})
    assert held.usage.completion_tokens >= 4
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, q, max_tokens=4, extra_body={"min_tokens": 5})
    assert e.value.body["param"] == "min_tokens"


def test_bad_words_are_never_completed(client):
    q = "Say only the word yes."
    assert chat(client, q).choices[0].message.content.startswith("Yes")
    text = chat(client, q, extra_body={"bad_words": ["Yes"]}).choices[0].message.content
    assert "Yes" not in text
    text = complete(client, "The capital of France is", extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in text and text.strip()


def test_allowed_token_ids_are_the_only_ones_picked(client, server):
    ids = httpx.post(server.base + "/tokenize", json={"model": MODEL, "prompt": "01"}).json()["tokens"]
    r = chat(client, "Count to ten.", extra_body={"allowed_token_ids": ids})
    assert set(r.choices[0].message.content) <= {"0", "1"} and r.usage.completion_tokens == 8
    r = complete(client, "Once upon a time", extra_body={"allowed_token_ids": ids})
    assert set(r.choices[0].text) <= {"0", "1"}
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "x", extra_body={"allowed_token_ids": [10 ** 6]})
    assert e.value.body["param"] == "allowed_token_ids"


# ------------------------------------------------------------------ structured outputs

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False}


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["sure thing", "never"]}, lambda t: t in ("sure thing", "never")),
    ({"structured_outputs": {"regex": "[0-9]{4}"}}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ({"structured_outputs": {"json": ANSWER}}, lambda t: json.loads(t)["answer"] in ("yes", "no")),
    ({"structured_outputs": {"grammar": 'root ::= ("yes" | "no") "!"'}}, lambda t: t in ("yes!", "no!")),
    ({"guided_grammar": 'root ::= "maybe" [0-9]'}, lambda t: re.fullmatch("maybe[0-9]", t)),
    ({"structured_outputs": {"json_object": True}}, lambda t: t.lstrip().startswith("{")),
], ids=["choice", "guided_choice", "regex", "json", "grammar", "guided_grammar", "json_object"])
def test_structured_outputs(client, body, check):
    text = chat(client, "Say hello.", max_tokens=24, extra_body=body).choices[0].message.content
    assert check(text), text


def test_structured_outputs_on_completions_and_their_errors(client):
    text = complete(client, "The year is", extra_body={"structured_outputs": {"regex": " [0-9]{4}\\."}}).choices[0].text
    assert re.fullmatch(r" [0-9]{4}\.", text)
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "x", extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert e.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, "x", extra_body={"guided_grammar": "root ::= ("})
    assert e.value.body["param"] == "guided_grammar"


# ------------------------------------------------------------------ chat rendering, streaming, the rest

FRANCE = [{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message(client):
    closed = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0)
    cont = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=8, temperature=0,
                                          extra_body={"continue_final_message": True, "add_generation_prompt": False})
    # the prompt ends inside the assistant's turn: no end of turn, no new assistant header
    assert cont.usage.prompt_tokens < closed.usage.prompt_tokens
    assert cont.choices[0].message.content.startswith(" Paris")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=2,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": True})
    assert e.value.body["param"] == "continue_final_message"


def test_chat_template_kwargs_are_bounded(client):
    deep: dict = {}
    for _ in range(80):
        deep = {"x": deep}
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=1, extra_body={"chat_template_kwargs": {"v": deep}})
    assert e.value.body["param"] == "chat_template_kwargs"
    # a variable this template does not use changes nothing
    assert chat(client, "hi", max_tokens=2, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices


def test_a_chat_template_from_the_request_is_refused_without_trust(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, "hi", max_tokens=1, extra_body={"chat_template": "{{ messages[0]['content'] }}"})
    assert e.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in e.value.body["message"]


def test_continuous_usage_stats(client):
    stream = chat(client, "hi", max_tokens=5, stream=True, stream_options={"include_usage": True},
                  extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    usages = [c.usage for c in stream]
    assert all(u is not None for u in usages)
    counts = [u.completion_tokens for u in usages]
    assert counts == sorted(counts) and counts[-1] == 5 and len(set(counts)) > 2
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


def test_continuous_usage_stats_count_each_choice_alone(client):
    """vLLM's shape: with n > 1 a chunk's usage is its own choice's tokens so far."""
    stream = chat(client, "hi", n=2, max_tokens=6, temperature=1.0, seed=3, stream=True,
                  extra_body={"ignore_eos": True,
                              "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    per: dict[int, list[int]] = {0: [], 1: []}
    final = None
    for c in stream:
        if not c.choices:
            final = c.usage
            continue
        per[c.choices[0].index].append(c.usage.completion_tokens)
    for counts in per.values():  # each choice rises to its own 6, never to the pair's 12
        assert counts == sorted(counts) and counts[-1] == 6
    assert final.completion_tokens == 12


def test_an_unknown_field_is_accepted_logged_once_and_counted(client, server):
    for _ in range(2):
        assert complete(client, "x", max_tokens=1, extra_body={"frobnicate_level": 3}).choices
    text = httpx.get(server.base + "/metrics").text
    assert 'superfluid_ignored_request_fields_total{field="frobnicate_level"} 2.0' in text
    assert server.log().count("'frobnicate_level' is accepted and ignored") == 1
