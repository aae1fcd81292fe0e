"""The file's own BOS rule (issue 25): a text prompt to /v1/completions, /tokenize and
LLM.generate gets the BOS token where the GGUF asks for one (tokenizer.ggml.add_bos_token:
Llama 3, Gemma, Llama 2's sentencepiece) and not where it does not (SmolLM2);
add_special_tokens on the request overrides. Chat never adds one: the template writes it."""

from __future__ import annotations

import httpx
import pytest

from serve_helpers import Server
from superfluid_testing.tiny import TinyModel

BOS = 1


@pytest.fixture(scope="module", params=[("gpt2", True), ("llama", True), ("gpt2", False)],
            ids=["bpe-asks", "spm-asks", "bpe-does-not"])
def served(request, tmp_path_factory):
    kind, asks = request.param
    path = TinyModel(tokenizer=kind, add_bos=asks, seed=3).write_gguf(tmp_path_factory.mktemp("bos") / "m.gguf")
    server = Server("--model", str(path), "--quant", "none", "--dtype", "float32", runtime="torch")
    yield asks, server, str(path)
    server.cleanup()


def _prompt_ids(server, model, **extra) -> list[int]:
    r = httpx.post(server.v1 + "/completions", json={"model": model, "prompt": "hello world", "max_tokens": 1,
                                                     "temperature": 0, "echo": True, "logprobs": 0, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completions_add_the_bos_the_file_asks_for(served):
    asks, server, model = served
    plain = httpx.post(server.base + "/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    default = httpx.post(server.base + "/tokenize", json={"prompt": "hello world"}).json()
    assert default["tokens"] == ([BOS] if asks else []) + plain["tokens"]
    body = _prompt_ids(server, model)
    assert body["usage"]["prompt_tokens"] == default["count"]
    off = _prompt_ids(server, model, add_special_tokens=False)
    assert off["usage"]["prompt_tokens"] == plain["count"]
    msgs = [{"role": "user", "content": "hi"}]
    chat = httpx.post(server.base + "/tokenize", json={"messages": msgs}).json()
    bare = httpx.post(server.base + "/tokenize", json={"messages": msgs, "add_special_tokens": False}).json()
    assert chat["tokens"] == bare["tokens"]  # the template writes its own BOS: never a second


def test_llm_generate_adds_the_bos_the_file_asks_for(tmp_path):
    from superfluid import LLM, SamplingParams

    for kind, asks in (("gpt2", True), ("gpt2", False)):
        path = TinyModel(tokenizer=kind, add_bos=asks, seed=3).write_gguf(tmp_path / f"{kind}{asks}.gguf")
        llm = LLM(str(path), quant="none", dtype="float32")
        try:
            out = llm.generate(["hello world"], SamplingParams(max_tokens=1, temperature=0))[0]
            assert (out.prompt_token_ids[0] == BOS) == asks
        finally:
            llm.close() if hasattr(llm, "close") else None
