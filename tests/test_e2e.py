"""End to end: ``superfluid serve`` with the default model, driven by the openai client.

One server per runtime, every test runs against both: ``torch --quant none`` (the fp32
reference numerics, the model in a worker process) and ``llamacpp`` (the file's own Q4_1
on llama.cpp's kernels, also in a worker). The default torch server (quantized,
batch-invariant): test_e2e_default.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, runtime: str = "torch"):
    """``superfluid serve`` on a free port with the default model; yields its base URL."""
    port = _free_port()
    exe = Path(sys.executable).with_name("superfluid")
    dtype = ["--dtype", "float32"] if runtime == "torch" else []
    cmd = [str(exe), "serve", "--runtime", runtime, "--port", str(port), *dtype, "--log-level", "warning",
           "--max-queued-requests", "64", *extra]
    log = open(ROOT / "tests" / ".e2e-server.log", "a") if os.environ.get("SUPERFLUID_E2E_LOG") else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT if log is not subprocess.DEVNULL else subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"superfluid serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("the server did not come up")
    yield base
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


RUNTIMES = ["torch", pytest.param("llamacpp", marks=pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed"))]


@pytest.fixture(scope="module", params=RUNTIMES)
def server(request):
    if request.param == "torch":
        # The reference numerics (transformers-equal); the default fast path: test_e2e_default.py.
        yield from start_server("--quant", "none")
    else:
        yield from start_server(runtime="llamacpp")


@pytest.fixture(scope="module")
def runtime(server):
    return httpx.get(server + "/health").json().get("runtime", "")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def ask(client, content: str, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **kw)


# ------------------------------------------------------------------ basics


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok" and h["pid"] > 0


def transformers_greedy_chat(question: str, n: int) -> tuple[int, str]:
    """transformers' greedy answer on the default GGUF in fp32: (prompt tokens, text), from
    the session's one load of it (hf_reference.py)."""
    pytest.importorskip("transformers")
    import torch

    from hf_reference import default_model, default_tokenizer

    tok, model = default_tokenizer(), default_model()
    text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return int(ids.shape[1]), tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_greedy_chat_matches_transformers(client, runtime):
    """Greedy text through the server equals transformers' generate on the same GGUF (fp32)."""
    if runtime.startswith("llamacpp"):
        pytest.skip("llama.cpp runs the file's Q4_1, not fp32: test_greedy_chat_matches_llamacpp_alone")
    question = "What is the capital of France? Answer in one sentence."
    n = 16
    got = ask(client, question, temperature=0, max_tokens=n)
    prompt_tokens, want = transformers_greedy_chat(question, n)
    assert got.usage.prompt_tokens == prompt_tokens
    assert got.choices[0].message.content == want


def test_greedy_chat_matches_llamacpp_alone(client, runtime):
    """Through the server (worker, scheduler, rings, detokenizer) greedy text equals a plain
    greedy loop over the llamacpp runtime in this process (transformers-equality of the
    runtime itself: test_llamacpp_runtime.py, on fp32 weights)."""
    if not runtime.startswith("llamacpp"):
        pytest.skip("the llamacpp server's check")
    import numpy as np

    from superfluid.runtimes.base import Feed
    from superfluid.runtimes.llamacpp.runtime import LlamaCppRuntime

    question = "What is the capital of France? Answer in one sentence."
    n = 16
    got = ask(client, question, temperature=0, max_tokens=n)
    rt = LlamaCppRuntime(MODEL, max_batch=2, n_ctx=1024)
    tok = rt.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True),
                     add_special_tokens=False)
    assert got.usage.prompt_tokens == len(ids)
    s = rt.seq_create()
    (row,) = rt.step([Feed(s, ids, True)])
    out = []
    for _ in range(n):
        t = int(np.argmax(row))
        if rt.is_eos(t):
            break
        out.append(t)
        (row,) = rt.step([Feed(s, [t], True)])
    rt.close()
    assert got.choices[0].message.content == tok.decode(out)


def test_completions_whole_and_streamed(client):
    whole = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    parts = []
    for chunk in client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=8, temperature=0, stream=True):
        parts.append(chunk.choices[0].text)
    assert "".join(parts) == whole.choices[0].text
    # a token-id prompt and a list of prompts
    ids_resp = client.completions.create(model=MODEL, prompt=[504, 1345], max_tokens=4, temperature=0)
    assert ids_resp.usage.prompt_tokens == 2
    multi = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in multi.choices) == [0, 1]


def test_chat_stream_with_usage(client):
    whole = ask(client, "Name a fruit.", temperature=0, max_tokens=16)
    text, usage = "", None
    for chunk in ask(client, "Name a fruit.", temperature=0, max_tokens=16, stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == whole.choices[0].message.content
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0


def test_n2_with_seed_is_reproducible(client):
    kw = dict(n=2, seed=1234, temperature=1.0, max_tokens=8)
    a = ask(client, "Write a short poem about the sea.", **kw)
    b = ask(client, "Write a short poem about the sea.", **kw)
    ta = [c.message.content for c in a.choices]
    assert ta == [c.message.content for c in b.choices]
    assert ta[0] != ta[1]


def test_stop_strings(client):
    base = ask(client, "Count from 1 to 10, separated by commas.", temperature=0, max_tokens=16).choices[0].message.content
    assert "," in base
    r = ask(client, "Count from 1 to 10, separated by commas.", temperature=0, max_tokens=16, stop=[","])
    assert r.choices[0].message.content == base[: base.index(",")]
    assert r.choices[0].finish_reason == "stop"


def test_logprobs_top5(client):
    r = ask(client, "Say hello.", temperature=0, max_tokens=8, logprobs=True, top_logprobs=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 5
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)  # greedy picks the top


def test_json_schema_response(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = ask(
        client,
        "Describe a person named Ada, aged 36, as JSON.",
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)


def test_logit_bias_bans_a_token(client):
    plain = ask(client, "What color is the sky?", temperature=0, max_tokens=6, logprobs=True)
    first = plain.choices[0].logprobs.content[0]
    from superfluid.models import resolve_model
    from superfluid.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(resolve_model(MODEL))
    banned = [i for i in tok.encode(first.token) if tok.token_bytes(i) == bytes(first.bytes)]
    assert banned, "the first token maps back to one id"
    r = ask(client, "What color is the sky?", temperature=0, max_tokens=6, logprobs=True, logit_bias={str(banned[0]): -100})
    assert all(bytes(t.bytes) != bytes(first.bytes) for t in r.choices[0].logprobs.content)


def test_max_tokens(client):
    r = ask(client, "Tell me a long story.", temperature=0, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kw,status",
    [
        (dict(messages=[]), 400),
        (dict(temperature=5), 400),
        (dict(top_p=2), 400),
        (dict(presence_penalty=9), 400),
        (dict(logprobs=True, top_logprobs=25), 400),
        (dict(n=99), 400),
        (dict(logit_bias={"999999": 1}), 400),
        (dict(logit_bias={"5": 500}), 400),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}), 400),
        (dict(model="no-such-model"), 404),
    ],
)
def test_bad_input(client, kw, status):
    body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    body.update(kw)
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(**body)
    assert e.value.status_code == status
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_bad_completion_inputs(client):
    for prompt in ("", [10**7], "word " * 9000):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert e.value.response.json()["error"]["message"]


def _ttft(server: str, prompt: str) -> tuple[float, int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, cached = None, None
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    return first if first is not None else time.perf_counter() - t0, cached


def test_prefix_cache_hit_is_reported_and_faster(server):
    # Up to three tries, each with a prefix of its own: a busy machine can slow one warm
    # request past its cold twin; the cache's ~10x cannot lose three times but for a fault.
    seen = []
    for attempt in range(3):
        shared = f"You are careful assistant number {attempt}. " + " ".join(
            f"Rule {i}: be concise and kind." for i in range(54))
        t_cold, cached_cold = _ttft(server, shared + " Question: what is two plus two?")
        t_warm, cached_warm = _ttft(server, shared + " Question: what is three plus five?")
        print(f"\nTTFT cold {t_cold:.3f} s, warm {t_warm:.3f} s ({cached_warm} cached prompt tokens)")
        assert cached_cold == 0
        assert cached_warm >= 512
        seen.append((t_warm, t_cold))
        if t_warm < t_cold:
            break
    assert any(w < c for w, c in seen), seen


def test_oversized_headers_are_refused_and_the_server_goes_on(server):
    # superfluid serve runs uvicorn's h11 parser for its header bound (server/limits.py);
    # httptools, which uvicorn would pick where it is installed, reads any size.
    try:
        status = httpx.get(server + "/health", headers={"x-big": "x" * (1 << 20)}, timeout=30).status_code
    except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
        status = "closed"  # refused while the client was still sending
    assert status in (400, "closed"), status
    assert httpx.get(server + "/health").json()["status"] == "ok"


def test_health_after_everything(server):
    h = httpx.get(server + "/health").json()
    assert h["status"] == "ok"
    text = httpx.get(server + "/metrics").text
    assert "superfluid_prefix_cache_hit_tokens" in text
