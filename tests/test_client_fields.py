"""End to end, the request fields vLLM honours (issue 27): the official ``openai`` client,
vLLM's fields through ``extra_body``, against one ``superfluid serve`` on the default model.

Each test would fail on a server that accepts the field and ignores it: the field is
chosen so that honouring it changes what comes back (a token that greedy decoding would
pick is banned, a finish that would come early is held back, and so on).
"""

from __future__ import annotations

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
