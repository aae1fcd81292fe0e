"""The OpenAI server on the toy runtime: shapes, streaming, every validation error."""

from __future__ import annotations

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient

from superfluid.engine.async_engine import AsyncEngine
from superfluid.engine.config import EngineConfig
from superfluid.engine.loader import build_engine
from superfluid.server.openai import create_app
from superfluid.server.stream_log import StreamConfig

MODEL = "toy"


def make_client(max_queued: int = 64, streams: StreamConfig = StreamConfig(), **engine_kw) -> TestClient:
    engine = build_engine(EngineConfig(runtime="toy", model=MODEL, **engine_kw))
    app = create_app(AsyncEngine(engine, max_queued=max_queued), streams=streams)
    return TestClient(app)


@pytest.fixture(scope="module")
def client():
    with make_client() as c:
        yield c


def chat_body(**kw):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}
    body.update(kw)
    return body


def sse_events(resp) -> list:
    events = []
    for line in resp.iter_lines():
        if not line or line.startswith("id: "):  # every event has an id (resumable streams)
            continue
        assert line.startswith("data: ")
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(resp, status: int, param: str | None = None, contains: str = ""):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    assert contains.lower() in err["message"].lower()
    return err


# ------------------------------------------------------------------ basics


def test_health_models_metrics(client):
    h = client.get("/health").json()
    assert h["status"] == "ok" and isinstance(h["pid"], int)
    m = client.get("/v1/models").json()
    assert m["object"] == "list" and m["data"][0]["id"] == MODEL
    client.post("/v1/completions", json={"model": MODEL, "prompt": "warm", "max_tokens": 2})
    text = client.get("/metrics").text
    for name in (
        "superfluid_requests_total",
        "superfluid_prompt_tokens_total",
        "superfluid_generation_tokens_total",
        "superfluid_time_to_first_token_seconds_bucket",
        "superfluid_inter_token_latency_seconds_bucket",
        "superfluid_queue_length",
        "superfluid_kv_cache_usage_ratio",
        "superfluid_prefix_cache_hit_tokens",
        "superfluid_spec_acceptance_ratio",
    ):
        assert name in text, name


def test_completion_shapes_string_list_and_token_ids(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5, "temperature": 0})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert choice["finish_reason"] in ("length", "stop") and isinstance(choice["text"], str)
    tok = client.app.state.engine.engine.tokenizer
    ids = tok.encode("hello")
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] <= 5
    # a list of strings: one choice per prompt; token ids give the same as their text
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["hello", "bye"], "max_tokens": 5, "temperature": 0})
    texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
    assert len(texts) == 2 and texts[0] == choice["text"]
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 5, "temperature": 0})
    assert r.json()["choices"][0]["text"] == choice["text"]


def test_chat_n_seed_reproducible_and_different(client):
    body = chat_body(n=2, seed=42, temperature=1.0, max_tokens=12, ignore_eos=True)
    a = client.post("/v1/chat/completions", json=body).json()
    b = client.post("/v1/chat/completions", json=body).json()
    ta = [c["message"]["content"] for c in a["choices"]]
    tb = [c["message"]["content"] for c in b["choices"]]
    assert ta == tb and ta[0] != ta[1]
    assert a["object"] == "chat.completion" and a["choices"][0]["message"]["role"] == "assistant"
    assert a["usage"]["completion_tokens"] == 24


def test_chat_stream_with_usage(client):
    with client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True}, temperature=0)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] >= 1
    assert "cached_tokens" in usage["usage"]["prompt_tokens_details"]
    whole = client.post("/v1/chat/completions", json=chat_body(temperature=0)).json()
    assert whole["choices"][0]["message"]["content"] == text


def test_completion_stream(client):
    with client.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["text"] for e in events[:-1])
    whole = client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "max_tokens": 6, "temperature": 0}).json()
    assert whole["choices"][0]["text"] == text


def test_logprobs_chat_and_completions(client):
    r = client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=5, temperature=0)).json()
    content = r["choices"][0]["logprobs"]["content"]
    assert len(content) == r["usage"]["completion_tokens"]
    for item in content:
        assert len(item["top_logprobs"]) == 5
        assert item["logprob"] <= 0 and isinstance(item["bytes"], list)
        # greedy: the chosen token is the most likely one
        assert item["top_logprobs"][0]["logprob"] == pytest.approx(item["logprob"])
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 3, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(len(t) <= 2 for t in lp["top_logprobs"])


def test_stop_strings_and_max_tokens(client):
    base = client.post("/v1/completions", json={"model": MODEL, "prompt": "stop test", "max_tokens": 30, "temperature": 0, "ignore_eos": True}).json()
    text = base["choices"][0]["text"]
    assert base["usage"]["completion_tokens"] == 30 and base["choices"][0]["finish_reason"] == "length"
    stop = text[4:6]
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "stop test", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stop": [stop]},
    ).json()
    assert r["choices"][0]["text"] == text[: text.find(stop)] and r["choices"][0]["finish_reason"] == "stop"


def test_json_object_response_format_parses(client):
    body = chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}},
        temperature=0, max_tokens=40)
    r = client.post("/v1/chat/completions", json=body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert json.loads(choice["message"]["content"]) in ({"ok": True}, {"ok": False})


def test_logit_bias_bans_a_token(client):
    base = client.post("/v1/completions", json={"model": MODEL, "prompt": "ban", "max_tokens": 10, "temperature": 0, "ignore_eos": True}).json()
    tok = client.app.state.engine.engine.tokenizer
    first_id = tok.encode(base["choices"][0]["text"])[0]
    first = tok.decode([first_id])
    tid = first_id
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "ban", "max_tokens": 10, "temperature": 0, "ignore_eos": True, "logit_bias": {str(tid): -100}},
    ).json()
    assert not r["choices"][0]["text"].startswith(first)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x" * 600}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [5, 99999]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [-1]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"100000": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logit_bias": {"five": 1}}, 400, "logit_bias"),
        ("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 17}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -0.1}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/chat/completions", chat_body(messages=[]), 400, "messages"),
        ("/v1/chat/completions", chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}), 400, "response_format"),
        ("/v1/chat/completions", chat_body(response_format={"type": "regex", "regex": "(unclosed"}), 400, "response_format"),
        ("/v1/chat/completions", chat_body(guided_regex="[a-"), 400, "guided_regex"),
        ("/v1/chat/completions", chat_body(response_format={"type": "yaml"}), 400, None),
        # pydantic errors come back as 400 in OpenAI's shape, not FastAPI's 422
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages"),
        ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", chat_body(model="nope"), 404, "model"),
    ],
)
def test_validation_errors(client, path, body, status, param):
    assert_error(client.post(path, json=body), status, param)


def test_malformed_json_and_unknown_route(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert_error(client.get("/v1/nothing"), 404)


def test_a_requests_chat_template_is_refused_unless_the_server_trusts_it(client):
    """vLLM's rule: a template sent with the request is code; only --trust-request-chat-template renders it."""
    template = "{% for m in messages %}SAY {{ m['content'] }}.{% endfor %}{% if add_generation_prompt %} >{% endif %}"
    err = assert_error(client.post("/v1/chat/completions", json=chat_body(chat_template=template)), 400,
                       "chat_template", "--trust-request-chat-template")
    assert err["code"] == "invalid_value"
    engine = build_engine(EngineConfig(runtime="toy", model=MODEL))
    with TestClient(create_app(AsyncEngine(engine), trust_request_chat_template=True)) as trusted:
        tok = engine.tokenizer
        r = trusted.post("/v1/chat/completions", json=chat_body(chat_template=template, max_tokens=1)).json()
        assert r["usage"]["prompt_tokens"] == len(tok.encode("SAY hello there. >"))
        plain = trusted.post("/v1/chat/completions", json=chat_body(max_tokens=1)).json()  # the model's own
        assert plain["usage"]["prompt_tokens"] == len(tok.encode(tok.apply_chat_template(chat_body()["messages"])))
        assert_error(trusted.post("/v1/chat/completions", json=chat_body(chat_template="{% if %}")), 400,
                     "chat_template", "rejected")
        too_long = "x" * ((1 << 17) + 1)
        assert_error(trusted.post("/v1/chat/completions", json=chat_body(chat_template=too_long)), 400, "chat_template")


def test_health_is_ok_after_errors(client):
    client.post("/v1/completions", json={"model": MODEL, "prompt": [99999]})
    assert client.get("/health").json()["status"] == "ok"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "still fine", "max_tokens": 2})
    assert r.status_code == 200


# ------------------------------------------------------------------ load and aborts


def test_queue_full_answers_429():
    with make_client(max_queued=1) as c:
        engine = c.app.state.engine
        results = []
        # Hold the loop thread so that requests pile up in the queue.
        gate = threading.Event()
        real_step = engine.engine.step

        def slow_step():
            gate.wait(5)
            return real_step()

        engine.engine.step = slow_step
        body = {"model": MODEL, "prompt": "queue", "max_tokens": 2}

        def post():
            results.append(c.post("/v1/completions", json=body))

        threads = [threading.Thread(target=post) for _ in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.15)
        gate.set()
        for t in threads:
            t.join(10)
        codes = sorted(r.status_code for r in results)
        assert 429 in codes and 200 in codes, codes
        err = next(r for r in results if r.status_code == 429)
        assert_error(err, 429)


def test_client_disconnect_aborts_the_stream():
    # slow steps (400 tokens >= 2 s): on a busy machine the request cannot finish before the disconnect lands;
    # no grace window (a stream then waits that long for its client to resume: test_responses.py)
    with make_client(streams=StreamConfig(grace_s=0), runtime_extra=(("step_delay", 0.005),)) as c:
        engine = c.app.state.engine
        body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    break  # the first event: go away
        deadline = time.time() + 30  # generous on a busy machine; the loop ends as soon as the lane is gone
        while time.time() < deadline and (engine.engine.scheduler.has_work()):
            time.sleep(0.05)
        sched = engine.engine.scheduler
        assert not sched.has_work(), "the aborted request's lane was retired"
        assert sched.stats.generation_tokens < 400


# ------------------------------------------------------------------ a worker process runs the model


def test_worker_crash_is_replayed_to_the_same_text():
    """The runtime in a worker process: /health names the worker's pid; a worker that
    dies mid-generation is replaced and its requests finish with the same text."""
    import os

    engine = build_engine(EngineConfig(runtime="toy", model=MODEL, worker=True))
    with TestClient(create_app(AsyncEngine(engine))) as c:
        pid = c.get("/health").json()["pid"]
        assert pid != os.getpid()
        body = chat_body(n=2, seed=5, temperature=0.9, max_tokens=200, ignore_eos=True)
        want = c.post("/v1/chat/completions", json=body).json()
        real_step = engine.step
        calls = {"n": 0}

        def step_then_kill():
            calls["n"] += 1
            if calls["n"] == 3:
                engine.ex.kill()
            return real_step()

        engine.step = step_then_kill
        got = c.post("/v1/chat/completions", json=body).json()
        assert [ch["message"]["content"] for ch in got["choices"]] == [ch["message"]["content"] for ch in want["choices"]]
        assert c.get("/health").json()["pid"] not in (pid, os.getpid())
