"""Hostile input against ``superfluid serve``: values legal for JSON but not for the engine,
clients that stop reading, idle connections, a missing credential. Each leaves every other
request with its undisturbed text."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import socket
import time

import httpx
import pytest

from serve_helpers import Server

STREAM = {"model": "toy", "prompt": "hello there", "max_tokens": 24, "temperature": 0.8, "ignore_eos": True,
          "stream": True}
# (endpoint, field, value): each passes a JSON parser and today's `int`/`float` types
POISON = [
    ("/v1/completions", "priority", 10**400),
    ("/v1/completions", "top_k", 2**64),
    ("/v1/chat/completions", "priority", -(10**400)),
    ("/v1/chat/completions", "top_k", 2**64),
    ("/v1/completions", "seed", 2**80),
    ("/v1/completions", "max_tokens", 10**30),
    ("/v1/chat/completions", "timeout", 1e308),
    ("/v1/completions", "stop_token_ids", [2**70]),
    ("/v1/completions", "prompt", [[1, 2, 2**70]]),
]


def poison_body(endpoint: str, field: str, value) -> bytes:
    body = {"model": "toy", "max_tokens": 4}
    if endpoint == "/v1/completions":
        body["prompt"] = "x"
    else:
        body["messages"] = [{"role": "user", "content": "x"}]
    body[field] = value
    return json.dumps(body).encode()


async def stream_texts(base: str, n: int, during=None) -> list[str]:
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(i: int) -> str:
            text = ""
            async with c.stream("POST", base + "/v1/completions", json=dict(STREAM, seed=i)) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"]
            return text

        tasks = [asyncio.create_task(one(i)) for i in range(n)]
        if during is not None:
            await asyncio.sleep(0.3)  # the streams are running
            await during(c)
        return await asyncio.gather(*tasks)


@pytest.fixture(scope="module")
def server():
    s = Server("--runtime-arg", "step_delay=0.01")
    yield s
    s.cleanup()


def test_poison_values_are_400s_naming_them_and_16_streams_keep_their_text(server):
    want = asyncio.run(stream_texts(server.base, 16))

    async def poison(c: httpx.AsyncClient) -> None:
        for _ in range(3):  # sent in a loop: the service must stay up
            for endpoint, field, value in POISON:
                r = await c.post(server.base + endpoint, content=poison_body(endpoint, field, value),
                                 headers={"content-type": "application/json"})
                assert r.status_code == 400, (field, r.text)
                err = r.json()["error"]
                assert err["param"] == field and err["type"] == "invalid_request_error", (field, err)

    got = asyncio.run(stream_texts(server.base, 16, during=poison))
    assert got == want
    assert server.health()["restarts"] == 0


def test_every_number_in_the_api_schema_is_bounded(server):
    """The fuzzer draws each bound and past it (schemathesis' coverage phase); a new
    unbounded field fails here first."""
    spec = httpx.get(server.base + "/openapi.json").json()
    unbounded = []

    def walk(node, path):
        if isinstance(node, dict):
            if node.get("type") in ("integer", "number"):
                lo = "minimum" in node or "exclusiveMinimum" in node
                hi = "maximum" in node or "exclusiveMaximum" in node
                if not (lo and hi):
                    unbounded.append(path)
            for k, v in node.items():
                walk(v, f"{path}.{k}")
        elif isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, f"{path}[{i}]")

    schemas = spec.get("components", {}).get("schemas", {})
    for name, schema in schemas.items():
        if name not in ("ValidationError", "HTTPValidationError"):  # FastAPI's response shapes, not input
            walk(schema, name)
    assert not unbounded, unbounded


def test_deeply_nested_json_is_a_400_not_a_500(server):
    for n in (5000, 100):  # past Python's parser; within it but past the schema bound
        _nested_bodies_are_400s(server, n)
    assert server.health()["status"] == "ok"


def _nested_bodies_are_400s(server, n: int) -> None:
    deep = '{"type":"object","properties":{"a":' * n + '{"type":"object"}' + "}}" * n  # as text: json can't write it
    user = '[{"role":"user","content":"x"}]'
    for endpoint, body, param in (
        ("/v1/completions", f'{{"model":"toy","prompt":"x","guided_json":{deep}}}', "guided_json"),
        ("/v1/completions", f'{{"model":"toy","prompt":"x","response_format":{{"type":"json_schema",'
                            f'"json_schema":{{"schema":{deep}}}}}}}', "response_format"),
        ("/v1/chat/completions", f'{{"model":"toy","messages":{user},"tools":[{{"type":"function",'
                                 f'"function":{{"name":"f","parameters":{deep}}}}}]}}', "tools.0.function.parameters"),
        ("/v1/chat/completions", f'{{"model":"toy","messages":[{{"role":"assistant","tool_calls":[{{"function":'
                                 f'{{"name":"f","arguments":{deep}}}}}]}},{{"role":"user","content":"x"}}]}}',
         "messages.0.tool_calls.0.function.arguments"),
    ):
        r = httpx.post(server.base + endpoint, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400, r.text[:300]
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        if n < 1000:  # parsed: the bound names the field
            assert err["param"] == param, err


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_reader_that_stops_is_cut_off_and_the_others_finish():
    # --stream-grace 1: a cut-off reader's request waits 1 s for it to resume (stream_hub.py), then is aborted
    s = Server("--stream-idle-timeout", "2", "--stream-grace", "1", "--runtime-arg", "max_seq_len=70000",
               "--runtime-arg", "n_cells=70000", "--max-request-tokens", "100000")
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", s.port))
        body = json.dumps({"model": "toy", "prompt": "stall", "max_tokens": 60000, "ignore_eos": True,
                           "temperature": 0, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        assert b"200 OK" in sock.recv(4096)
        t0 = time.monotonic()  # from here the client reads nothing
        others = asyncio.run(stream_texts(s.base, 4))  # meanwhile the rest stream at full rate
        assert all(others) and time.monotonic() - t0 < 30
        deadline = time.monotonic() + 20  # past the idle timeout and the grace: the reader is cut off
        while _metric(s.base, 'superfluid_requests_total{finish_reason="abort"}') < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _metric(s.base, 'superfluid_requests_total{finish_reason="abort"}') == 1
        assert _metric(s.base, "superfluid_running_requests") == 0
        sock.settimeout(10)
        rest = b""
        while chunk := sock.recv(1 << 16):  # what was buffered, then the server's close
            rest += chunk
        # cut off: at the idle timeout (the connection closes mid-stream) or, if the engine ran
        # MAX_BACKLOG deltas ahead of the reader first, aborted (it then says "abort"): never "length"
        assert b"[DONE]" not in rest or b'"finish_reason":"abort"' in rest
        assert b'"finish_reason":"length"' not in rest
        sock.close()
    finally:
        s.cleanup()


def test_a_thousand_idle_connections_then_a_normal_request_succeeds():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    s = Server("--header-timeout", "3")
    idle = []
    try:
        for _ in range(1000):
            c = socket.create_connection(("127.0.0.1", s.port))
            idle.append(c)
        r = httpx.post(s.v1 + "/completions", json={"model": "toy", "prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        time.sleep(4)  # past the header deadline: the idle connections are closed by the server
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for c in idle:
            c.close()
        s.cleanup()


def test_a_body_that_never_arrives_is_a_408():
    s = Server("--body-timeout", "1")
    try:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 100\r\n\r\n{\"model\"")
        sock.settimeout(10)
        assert b" 408 " in sock.recv(4096).split(b"\r\n")[0] + b" "
        sock.close()
        assert s.health()["status"] == "ok"
    finally:
        s.cleanup()


ROUTES = [("POST", "/v1/completions", {"model": "toy", "prompt": "hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "hi"}],
                                            "max_tokens": 2}),
          ("GET", "/v1/models", None),
          ("POST", "/tokenize", {"prompt": "hi"}),
          ("POST", "/detokenize", {"tokens": [1, 2]})]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_the_api_key_is_enforced_on_every_api_route(how):
    key = "sk-test-123"
    s = Server("--api-key", key) if how == "flag" else Server(env={"SUPERFLUID_API_KEY": key})
    try:
        for method, path, body in ROUTES:
            for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                    ({"Authorization": f"Bearer {key}"}, 200)):
                r = httpx.request(method, s.base + path, json=body, headers=headers, timeout=30)
                assert r.status_code == status, (path, headers, r.text)
                if status == 401:
                    assert r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(s.base + "/health").status_code == 200  # open: probes
        assert httpx.get(s.base + "/metrics").status_code == 200  # open: scrapers
    finally:
        s.cleanup()


def test_the_cluster_drain_route_is_protected_and_exposure_warns():
    from superfluid.server.auth import protected
    from superfluid.server.http_config import exposure_warning

    assert protected("/v1/cluster/replicas/r0/drain") and protected("/v1/models") and protected("/tokenize")
    assert not protected("/health") and not protected("/metrics") and not protected("/")
    assert exposure_warning("0.0.0.0", None) and exposure_warning("10.1.2.3", None)
    assert exposure_warning("0.0.0.0", "k") is None and exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("localhost", None) is None and exposure_warning("::1", None) is None


def _expensive_schema(n: int) -> dict:
    # 20 bounded repeats: xgrammar's compile grows with the bound (toy vocabulary: n=3000 ~7 s, 1000 ~0.8 s)
    return {"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "[a-z]{1,%d}" % n}
                                             for i in range(20)}}


def test_an_expensive_schema_is_refused_within_its_budget_and_8_streams_do_not_stall():
    s = Server("--runtime-arg", "step_delay=0.01", "--runtime-arg", "max_seq_len=4096", "--runtime-arg", "n_cells=16384")
    time.sleep(3)  # the worker sets up xgrammar in the background at start (~1.5 s here); then it is steady state
    try:
        async def main():
            gaps: list[float] = []
            async with httpx.AsyncClient(timeout=120) as c:
                async def one(i: int) -> None:
                    body = dict(STREAM, seed=i, max_tokens=700)
                    last = None
                    async with c.stream("POST", s.base + "/v1/completions", json=body) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: {"):
                                now = time.monotonic()
                                if last is not None:
                                    gaps.append(now - last)
                                last = now

                async def expensive(n: int) -> tuple[int, dict, float]:
                    t0 = time.monotonic()
                    r = await c.post(s.base + "/v1/completions", json={
                        "model": "toy", "prompt": "x", "max_tokens": 4,
                        "response_format": {"type": "json_schema", "json_schema": {"schema": _expensive_schema(n)}}})
                    return r.status_code, r.json(), time.monotonic() - t0

                streams = [asyncio.create_task(one(i)) for i in range(8)]
                await asyncio.sleep(0.5)
                status, body, took = await expensive(3000)
                again = await expensive(3000)  # refused at once: never compiled twice
                fine = await expensive(200)  # a cheap schema still compiles and runs
                await asyncio.gather(*streams)
            return gaps, (status, body, took), again, fine

        gaps, (status, body, took), again, fine = asyncio.run(main())
        assert status == 400 and body["error"]["param"] == "response_format", body
        assert "longer than" in body["error"]["message"] and took < 15
        assert again[0] == 400 and again[2] < 1.0, again
        assert fine[0] == 200, fine
        gaps.sort()
        p99 = gaps[int(0.99 * (len(gaps) - 1))]
        # p99 as the issue states it; the max too, loosely (a busy machine), since p99 over 8
        # streams cannot see one stall a stream: compiling on the tick loop stalled 5-7 s
        assert len(gaps) > 1000 and p99 < 1.0 and gaps[-1] < 2.5, (p99, gaps[-5:])
        assert s.health()["restarts"] == 0  # the worker was never killed over it
    finally:
        s.cleanup()
