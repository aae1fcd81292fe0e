"""``/v1/responses`` and resumable streams, on the toy runtime, through the official
openai client: the response object and its typed events, a function-tool round trip,
stored conversations over ``previous_response_id`` (cached tokens, bounds, a restart),
background responses, and streams cut after 10 events and resumed with ``Last-Event-ID``
(also with the worker SIGKILLed while the client is away) that reassemble to exactly the
uninterrupted text. The toy's logits are a function of the token history, so a seeded
stream's text is the same on every run. The three-turn equality with chat histories on
the real model: test_responses_default.py.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from serve_helpers import Server

openai = pytest.importorskip("openai")

MODEL = "toy"
GRACE_S = 3.0
LONG = {"max_output_tokens": 300, "temperature": 0.9, "extra_body": {"seed": 11, "ignore_eos": True}}


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def server(state_dir):
    # 10 ms a runtime step: a 300-token stream outlasts a cut, a kill and a resume; a context
    # that holds the tools' system text
    s = Server("--runtime-arg", "step_delay=0.01", "--runtime-arg", "max_seq_len=2048", "--runtime-arg",
               "n_cells=32768", "--state-dir", str(state_dir), "--stream-grace", str(GRACE_S))
    yield s
    s.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)


def sse(raw: bytes) -> list[dict]:
    """Raw SSE -> events: {"id", "event", "data", "raw"} (raw: the event's bytes)."""
    out = []
    for block in raw.split(b"\n\n"):
        if not block.strip():
            continue
        ev = {"raw": block + b"\n\n", "id": None, "event": None, "data": None}
        for line in block.decode().split("\n"):
            key, _, value = line.partition(": ")
            ev[key] = value
        out.append(ev)
    return out


def metric(server, name: str) -> float:
    for line in httpx.get(server.base + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


# ------------------------------------------------------------------ the endpoint


def test_create_retrieve_delete(client):
    r = client.responses.create(model=MODEL, input="hello there", instructions="Answer in toy words.",
                                max_output_tokens=12, temperature=0.8, metadata={"k": "v"}, extra_body={"seed": 5})
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text
    assert r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 12
    assert r.usage.input_tokens_details.cached_tokens == 0 and r.metadata == {"k": "v"}
    assert r.instructions == "Answer in toy words." and r.temperature == 0.8
    again = client.responses.retrieve(r.id)
    assert again.output_text == r.output_text and again.usage == r.usage
    # the same seed, the same text
    twin = client.responses.create(model=MODEL, input="hello there", instructions="Answer in toy words.",
                                   max_output_tokens=12, temperature=0.8, extra_body={"seed": 5})
    assert twin.output_text == r.output_text
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="next", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"


def test_bad_requests_name_their_field(client):
    cases = [
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input.0.content.0.type"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 3}, "temperature"),
        ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"input": "hi", "store": False, "background": True}, "background"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **{k: v for k, v in extra.items() if k != "metadata"},
                                    extra_body={"metadata": extra["metadata"]} if "metadata" in extra else None)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_stream_events_match_the_whole_response(client):
    kw = dict(model=MODEL, input="stream me a story", max_output_tokens=40, temperature=0.7, extra_body={"seed": 9})
    whole = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response() if whole.status == "completed" else None
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    if final is not None:
        assert final.output_text == whole.output_text
    assert client.responses.retrieve(events[0].response.id).output_text == whole.output_text


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
    # seeded and with room: the schema's grammar allows whitespace, which the toy model may spend tokens on
    r = client.responses.create(model=MODEL, input="json please", max_output_tokens=400, extra_body={"seed": 3},
                                text={"format": {"type": "json_schema", "name": "flag", "schema": schema}})
    assert r.text.format.type == "json_schema"
    assert isinstance(json.loads(r.output_text)["a"], bool)


def test_every_streamed_event_of_every_endpoint_has_an_id(server):
    bodies = {
        "/v1/completions": {"model": MODEL, "prompt": "ids", "max_tokens": 5, "stream": True},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "ids"}], "max_tokens": 5,
                                 "stream": True, "stream_options": {"include_usage": True}},
        "/v1/responses": {"model": MODEL, "input": "ids", "max_output_tokens": 5, "stream": True},
    }
    for path, body in bodies.items():
        events = sse(httpx.post(server.base + path, json=body, timeout=60).content)
        assert len(events) >= 4, path
        sid = events[0]["id"].rpartition(":")[0]
        assert [e["id"] for e in events] == [f"{sid}:{i}" for i in range(len(events))], path
        if path == "/v1/responses":
            assert sid == json.loads(events[0]["data"])["response"]["id"]
            assert all(e["event"] == json.loads(e["data"])["type"] for e in events)
        else:
            assert sid == json.loads(events[0]["data"])["id"] and events[-1]["data"] == "[DONE]"


# ------------------------------------------------------------------ tools


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}


def test_a_function_tool_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=200,
                                    temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) >= 1 and first.status == "completed", first.output
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    # the client runs the tool and sends its output, carried by previous_response_id
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temperature": 21}'}],
                                     max_output_tokens=12, temperature=0)
    assert second.output[0].type == "message" and second.output_text
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first turn's prefix was leased
    # the same turns as a whole chat history give the same answer
    chat = openai.OpenAI(base_url=client.base_url, api_key="none").chat.completions.create(
        model=MODEL, temperature=0, max_tokens=12,
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        messages=[{"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                      for c in calls]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 21}'}])
    assert chat.choices[0].message.content == second.output_text


def test_streamed_function_call_arguments(client):
    with client.responses.stream(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200) as s:
        events = list(s)
        final = s.get_final_response()
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == fragments and json.loads(fragments)["city"] is not None
    assert final.output[0].type == "function_call" and final.output[0].arguments == fragments


# ------------------------------------------------------------------ stored conversations


def test_a_conversation_over_previous_response_id_leases_its_prefix(client):
    r, cached = None, []
    for turn in range(3):
        r = client.responses.create(model=MODEL, input=f"turn {turn}: tell me more", max_output_tokens=16,
                                    temperature=0, previous_response_id=r.id if r else None)
        cached.append(r.usage.input_tokens_details.cached_tokens)
    # turn 1 may find the template's opening cached; turns 2 and 3 lease their conversation
    assert cached[1] > cached[0] + 16 and cached[2] > cached[1] + 16, cached


def _app(state_dir, **store_kw):
    from superfluid.engine.async_engine import AsyncEngine
    from superfluid.engine.config import EngineConfig
    from superfluid.engine.loader import build_engine
    from superfluid.server.openai import create_app
    from superfluid.server.responses.store import StoreConfig

    engine = build_engine(EngineConfig(runtime="toy", model=MODEL))
    return TestClient(create_app(AsyncEngine(engine), store=StoreConfig(state_dir=str(state_dir), **store_kw)))


def _turn(c, text: str, previous: str | None = None) -> dict:
    r = c.post("/v1/responses", json={"model": MODEL, "input": text, "max_output_tokens": 8, "temperature": 0,
                                      "previous_response_id": previous})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_store_survives_a_restart_and_keeps_its_bounds(tmp_path):
    with _app(tmp_path) as c:
        one = _turn(c, "first")
        two = _turn(c, "second", one["id"])
        three = _turn(c, "third", two["id"])
    with _app(tmp_path) as c:  # a new server on the same state directory
        assert c.get(f"/v1/responses/{one['id']}").json() == one
        again = _turn(c, "third", two["id"])  # the KV is gone: prefilled again, the same text
        assert again["output"][0]["content"][0]["text"] == three["output"][0]["content"][0]["text"]
        assert again["usage"]["input_tokens"] == three["usage"]["input_tokens"]
    with _app(tmp_path, max_stored=3) as c:  # 4 stored: the oldest goes at once
        assert c.get(f"/v1/responses/{one['id']}").status_code == 404
        assert c.get(f"/v1/responses/{two['id']}").status_code == 200
        _turn(c, "fifth")
        assert c.get(f"/v1/responses/{two['id']}").status_code == 404
        assert 'superfluid_responses_evicted_total{reason="count"} 2.0' in c.get("/metrics").text
        assert "superfluid_responses_stored 3.0" in c.get("/metrics").text
    with _app(tmp_path, max_age_s=0.5) as c:
        time.sleep(0.6)
        assert c.get(f"/v1/responses/{three['id']}").status_code == 404
        r = c.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": three["id"]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"
        assert 'superfluid_responses_evicted_total{reason="age"}' in c.get("/metrics").text


def test_store_false_is_not_kept(client):
    r = client.responses.create(model=MODEL, input="forget me", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_a_background_response_is_polled_and_streamed(client):
    r = client.responses.create(model=MODEL, input="in the background", background=True, max_output_tokens=60,
                                temperature=0)
    assert r.status == "in_progress" and r.background
    deadline = time.monotonic() + 60
    while r.status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.1)
        r = client.responses.retrieve(r.id)
    assert r.status in ("completed", "incomplete") and r.output_text
    events = list(client.responses.retrieve(r.id, stream=True))
    assert events[0].type == "response.created" and events[-1].response.output_text == r.output_text
    later = list(client.responses.retrieve(r.id, stream=True, starting_after=5))
    assert [e.sequence_number for e in later] == [e.sequence_number for e in events[6:]]


# ------------------------------------------------------------------ resumable streams


def _text(events) -> str:
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


def _read_then_close(stream, n: int = 10) -> list:
    """The first ``n`` events of an openai client stream, then its connection closed."""
    got = []
    for e in stream:
        got.append(e)
        if len(got) == n:
            break
    stream.close()
    return got


def _cut_after_10(client, **kw):
    """A stream read for 10 events, then its connection closed: (id, the events read)."""
    got = _read_then_close(client.responses.create(model=MODEL, input="a long story please", stream=True, **kw))
    return got[0].response.id, got


@pytest.fixture(scope="module")
def reference(client):
    with client.responses.stream(model=MODEL, input="a long story please", **LONG) as s:
        return _text(list(s))


def test_a_cut_stream_resumed_with_last_event_id_reassembles(server, client, reference):
    rid, first = _cut_after_10(client, **LONG)
    rest = client.responses.create(model=MODEL, input="a long story please", stream=True, **LONG,
                                   extra_headers={"Last-Event-ID": f"{rid}:9"})
    rest = list(rest)
    assert rest[0].sequence_number == 10 and rest[-1].type == "response.incomplete"
    assert _text(first + rest) == reference
    # the same rest, byte for byte, from GET ?stream=true&starting_after=9 and from Last-Event-ID
    by_query = httpx.get(f"{server.v1}/responses/{rid}", params={"stream": "true", "starting_after": 9}).content
    by_header = httpx.post(f"{server.v1}/responses", headers={"Last-Event-ID": f"{rid}:9"}, timeout=60,
                           json={"model": MODEL, "input": "a long story please", "stream": True}).content
    assert by_query == by_header and sse(by_query)[0]["id"] == f"{rid}:10"
    full = httpx.get(f"{server.v1}/responses/{rid}", params={"stream": "true"}).content
    assert full.endswith(by_query)
    assert client.responses.retrieve(rid).output_text == reference


def test_a_cut_stream_resumes_after_the_worker_was_sigkilled_meanwhile(server, client, reference):
    log_before = len(server.log())
    rid, first = _cut_after_10(client, **LONG)
    pid = server.health()["pid"]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        h = server.health()
        if h["status"] == "ok" and h["pid"] not in (None, pid):
            break
        time.sleep(0.05)
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=first[-1].sequence_number))
    assert _text(first + rest) == reference
    log = server.log()[log_before:]
    assert "the model worker was lost" in log and "while idle" not in log  # it was killed mid-generation


def test_a_chat_stream_resumes_within_the_grace_window(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "chat for a while"}], max_tokens=200,
              temperature=0.9, seed=4, extra_body={"ignore_eos": True})
    want = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw))
    got = _read_then_close(client.chat.completions.create(stream=True, **kw))
    time.sleep(0.5)
    rest = list(client.chat.completions.create(stream=True, **kw, extra_headers={"Last-Event-ID": f"{got[0].id}:9"}))
    assert rest[0].id == got[0].id
    assert "".join(c.choices[0].delta.content or "" for c in got + rest) == want


def test_a_chat_stream_nobody_resumes_is_aborted_after_the_grace_window(server, client):
    before = metric(server, 'superfluid_requests_total{finish_reason="abort"}')
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "left"}],
                                            max_tokens=2000, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    left = time.monotonic()
    time.sleep(GRACE_S / 3)
    assert metric(server, 'superfluid_requests_total{finish_reason="abort"}') == before  # still waiting for its client
    while metric(server, 'superfluid_requests_total{finish_reason="abort"}') == before:
        assert time.monotonic() - left < GRACE_S + 20, "the abandoned stream was never aborted"
        time.sleep(0.1)
    assert time.monotonic() - left >= GRACE_S - 0.5


def test_resuming_what_is_not_there(server, client):
    r = httpx.post(f"{server.v1}/chat/completions", headers={"Last-Event-ID": "chatcmpl-nope:3"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    r = httpx.post(f"{server.v1}/completions", headers={"Last-Event-ID": "garbage"},
                   json={"model": MODEL, "prompt": "x", "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
    with pytest.raises(openai.NotFoundError):
        list(client.responses.retrieve("resp_unknown", stream=True))


def test_retained_streams_are_bounded_by_time_count_and_bytes():
    from superfluid.engine.async_engine import AsyncEngine
    from superfluid.engine.config import EngineConfig
    from superfluid.engine.loader import build_engine
    from superfluid.server.openai import create_app
    from superfluid.server.stream_log import StreamConfig

    def app(**kw):
        return TestClient(create_app(AsyncEngine(build_engine(EngineConfig(runtime="toy", model=MODEL))),
                                     streams=StreamConfig(**kw)))

    def run(c, n: int = 8) -> tuple[str, bytes]:
        raw = c.post("/v1/completions", json={"model": MODEL, "prompt": "b", "max_tokens": n, "stream": True}).content
        return sse(raw)[0]["id"].rpartition(":")[0], raw

    def resume(c, sid: str, after: int = 0):
        return c.post("/v1/completions", headers={"Last-Event-ID": f"{sid}:{after}"},
                      json={"model": MODEL, "prompt": "b", "stream": True})

    with app(max_streams=2) as c:
        sids = [run(c)[0] for _ in range(3)]
        assert [resume(c, sid).status_code for sid in sids] == [404, 200, 200]  # the oldest finished one went
    with app(retention_s=0.5) as c:
        sid, raw = run(c)
        first = sse(raw)[0]["raw"]
        assert resume(c, sid).content == raw[len(first):]  # byte for byte
        time.sleep(0.6)
        r = resume(c, sid)
        assert r.status_code == 404 and r.json()["error"]["code"] == "stream_not_found"
    with app(max_bytes=6000) as c:
        old, raw = run(c, 12)
        assert len(raw) > 3000
        new, _ = run(c, 12)  # two such streams do not fit: the older finished one goes
        assert resume(c, old).status_code == 404 and resume(c, new).status_code == 200
