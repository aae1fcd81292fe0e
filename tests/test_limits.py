"""Bounded inputs at the door (issue 11): a body cap answered 413 before any parsing, prompt
text capped in characters before tokenising, stop and n x max_tokens caps, roles checked."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from superfluid.engine.async_engine import AsyncEngine
from superfluid.engine.config import EngineConfig
from superfluid.engine.loader import build_engine
from superfluid.server.limits import Limits
from superfluid.server.openai import create_app

from test_server import MODEL, assert_error, chat_body


@pytest.fixture(scope="module")
def client():
    engine = build_engine(EngineConfig(runtime="toy", model=MODEL, max_request_tokens=1024))
    app = create_app(AsyncEngine(engine, max_queued=64), limits=Limits(max_body_bytes=1 << 20, max_prompt_chars=20_000))
    with TestClient(app) as c:
        yield c


def test_a_body_over_the_cap_is_413_and_costs_no_parse(client):
    big = chat_body(messages=[{"role": "user", "content": "x" * (2 << 20)}])
    t = time.perf_counter()
    r = client.post("/v1/chat/completions", json=big)
    assert_error(r, 413, contains="larger than")
    assert time.perf_counter() - t < 5.0  # generous: the point is no multi-second parse and tokenise
    # streamed without a content-length, the same
    raw = b'{"model": "toy", "messages": [{"role": "user", "content": "' + b"y" * (2 << 20) + b'"}]}'
    r = client.post("/v1/chat/completions", content=iter([raw[i:i + 65536] for i in range(0, len(raw), 65536)]),
                    headers={"content-type": "application/json"})
    assert_error(r, 413)
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200  # the server is fine


def test_prompt_text_is_capped_in_characters_before_tokenising(client):
    assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * 30_000, "max_tokens": 2}),
                 400, "prompt", "characters")
    long_chat = chat_body(messages=[{"role": "user", "content": "w" * 12_000}] * 2)
    assert_error(client.post("/v1/chat/completions", json=long_chat), 400, "messages", "characters")


def test_unknown_role_is_400_naming_the_field(client):
    r = client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "wizard", "content": "hi"}]))
    err = assert_error(r, 400)
    assert "messages.0.role" in err["message"]
    r = client.post("/v1/chat/completions", json=chat_body(messages=[{"role": "developer", "content": "be brief"},
                                                                      {"role": "user", "content": "hi"}]))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kw, param", [
    (dict(stop=["a"] * 17), "stop"),
    (dict(stop=["q" * 257]), "stop"),
    (dict(stop_token_ids=list(range(65))), "stop_token_ids"),
    (dict(n=4, max_tokens=400), "max_tokens"),  # 1,600 > the 1,024 this server allows per request
])
def test_request_size_caps(client, kw, param):
    assert_error(client.post("/v1/chat/completions", json=chat_body(**kw)), 400, param)


def test_a_grammar_the_vocabulary_cannot_follow_is_400_not_500(client):
    """Found by the API fuzzer: a regex no token of the toy vocabulary can start (\\u008b)
    ended the lane with GRAMMAR_OVERFLOW, answered 500."""
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "0L", "guided_regex": "\u008b", "max_tokens": 4})
    assert_error(r, 400, "response_format", "grammar")
    assert client.post("/v1/chat/completions", json=chat_body()).status_code == 200


def test_a_request_past_its_deadline_ends_with_an_error_and_frees_its_lane():
    from test_server import make_client, sse_events

    with make_client(runtime_extra=(("step_delay", 0.02),)) as c:  # 300 tokens take >= 6 s
        body = {"model": MODEL, "prompt": "slow", "max_tokens": 300, "ignore_eos": True, "timeout": 0.5}
        t = time.perf_counter()
        err = assert_error(c.post("/v1/completions", json=body), 503, "timeout", "deadline")
        assert err["code"] == "deadline_exceeded" and time.perf_counter() - t < 4.0  # not the whole 6 s
        with c.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]" and "deadline" in events[-2]["error"]["message"]
        sched = c.app.state.engine.engine.scheduler
        deadline = time.time() + 5
        while time.time() < deadline and sched.has_work():
            time.sleep(0.05)
        assert not sched.has_work()  # the lanes were retired, not left generating
        assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        assert_error(c.post("/v1/completions", json=dict(body, timeout=-1)), 400, "timeout")


def test_logprobs_of_impossible_tokens_are_floored_not_minus_infinity(client):
    """Found by the chaos load test: under a grammar mask a top_logprobs entry can be -inf,
    which JSON cannot carry (the answer failed). OpenAI floors logprobs at -9999."""
    r = client.post("/v1/chat/completions", json=chat_body(response_format={"type": "json_object"}, logprobs=True,
                                                            top_logprobs=20, max_tokens=6))
    assert r.status_code == 200, r.text
    values = [t["logprob"] for c in r.json()["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]]
    assert values and min(values) >= -9999.0
