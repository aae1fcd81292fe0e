"""vLLM's Python shapes and the token rules below the server (issue 27), on the toy runtime:
``LLM``'s vLLM arguments, ``LLM.chat``'s template arguments, ``RequestOutput.prompt_logprobs``,
the tokenizer's transformers names, and min_tokens / bad_words / allowed_token_ids in
``SamplingParams``."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from superfluid import LLM, SamplingParams
from superfluid.engine.async_engine import AsyncEngine
from superfluid.engine.config import EngineConfig
from superfluid.engine.loader import build_engine
from superfluid.engine.params import ParamError
from superfluid.engine.stop import StopChecker
from superfluid.executor.token_rules import TokenRules
from superfluid.runtimes.toy_vocab import EOS
from superfluid.server.openai import create_app

P = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(runtime="toy", max_model_len=96, max_num_seqs=3)


def test_vllm_constructor_arguments(llm):
    assert llm.engine.max_seq_len == 96
    assert llm.engine.config.scheduler.max_running == 3
    with pytest.raises(TypeError, match="'frobnicate'"):
        LLM(runtime="toy", frobnicate=1)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(runtime="toy", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="quantization"):
        LLM(runtime="toy", quantization="awq")
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(runtime="toy", tokenizer="/no/such/tokenizer")


def test_an_llm_seed_makes_unseeded_sampling_repeat():
    sp = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    runs = [[o.outputs[0].token_ids for o in LLM(runtime="toy", seed=11).generate(["a", "b"], sp)] for _ in range(2)]
    assert runs[0] == runs[1] and runs[0][0] != runs[0][1]
    other = [o.outputs[0].token_ids for o in LLM(runtime="toy", seed=12).generate(["a", "b"], sp)]
    assert other != runs[0]


def test_request_output_prompt_logprobs(llm):
    out = llm.generate(["hello world"], P.with_(prompt_logprobs=1))[0]
    assert out.prompt_logprobs is out.outputs[0].prompt_logprobs
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None


def test_chat_template_arguments(llm, monkeypatch):
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "well"}]
    assert llm.chat(conv, P, continue_final_message=True)[0].prompt.endswith("<|assistant|>well")
    with pytest.raises(ValueError, match="cannot both"):
        llm.chat(conv, P, continue_final_message=True, add_generation_prompt=True)
    got = llm.chat(conv[:1], P, chat_template="{{ greet }}{{ tools[0]['name'] }}:{{ messages[0]['content'] }}",
                   chat_template_kwargs={"greet": "yo "}, tools=[{"name": "f"}])[0]
    assert got.prompt == "yo f:hi"
    monkeypatch.setattr(llm.get_tokenizer(), "add_bos", True)  # as a file that asks for BOS
    without = llm.chat(conv[:1], P)[0]
    with_bos = llm.chat(conv[:1], P, add_special_tokens=True)[0]
    assert with_bos.prompt_token_ids == [llm.get_tokenizer().bos_token_id] + without.prompt_token_ids


def test_tokenizer_transformers_names(llm):
    tok = llm.get_tokenizer()
    assert tok.eos_token_id == EOS and tok.bos_token_id is not None and tok.pad_token_id is None
    ids = tok.encode("the cab")
    pieces = tok.convert_ids_to_tokens(ids)
    assert "".join(pieces) == "the cab" and tok.convert_tokens_to_ids(pieces) == ids
    assert tok.convert_ids_to_tokens(ids[0]) == pieces[0] and tok.convert_tokens_to_ids("no such piece") is None
    assert len(tok) == tok.vocab_size and tok.get_vocab()[pieces[0]] == ids[0]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True) == tok.encode("<|user|>x\n<|assistant|>")


# ------------------------------------------------------------------ token rules


def test_allowed_token_ids_and_bad_words(llm):
    tok = llm.get_tokenizer()
    allowed = tok.encode("ab")
    out = llm.generate(["hello"], P.with_(allowed_token_ids=allowed))[0].outputs[0]
    assert set(out.token_ids) <= set(allowed)
    base = llm.generate(["hello"], P)[0].outputs[0]
    word = tok.decode(base.token_ids[:2])
    banned = llm.generate(["hello"], P.with_(bad_words=[word]))[0].outputs[0]
    assert banned.token_ids[:2] != base.token_ids[:2] and word not in banned.text
    with pytest.raises(ParamError, match="allowed_token_ids"):
        llm.generate(["x"], P.with_(allowed_token_ids=[10 ** 6]))
    with pytest.raises(ParamError, match="min_tokens"):
        llm.generate(["x"], P.with_(min_tokens=7))


def test_token_rules_follow_the_output_not_the_prompt():
    rules = TokenRules.build(8, None, [[3], [1, 2]], min_tokens=2, min_ban=[0])
    row = np.zeros(8, dtype=np.float32)
    rules.apply(row, committed=[9, 1], out_start=2)  # nothing generated (the 1 is the prompt's): 2 stays
    assert np.isneginf(row[[0, 3]]).all() and np.isfinite(row[[1, 2, 4]]).all()
    row = np.zeros(8, dtype=np.float32)
    rules.apply(row, committed=[9, 9, 1], out_start=1)  # two generated, the last is 1: 2 is banned, EOS free
    assert np.isneginf(row[[2, 3]]).all() and np.isfinite(row[0])
    with pytest.raises(ValueError):
        TokenRules.build(8, [9], [], 0, [])


def test_min_tokens_arms_stop_strings_late():
    s = StopChecker([","])
    assert s.push("1,", armed=False) == "1," and s.stopped is None
    assert s.push(" 2,", armed=True) == " 2" and s.stopped == ","


def test_add_special_tokens_on_chat():
    engine = build_engine(EngineConfig(runtime="toy", model="toy"))
    engine.tokenizer.add_bos = True  # as a file that asks for BOS: the template's text gets none unless asked
    app = create_app(AsyncEngine(engine, max_queued=8))
    with TestClient(app) as c:
        body = {"model": "toy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        plain = c.post("/v1/chat/completions", json=body).json()["usage"]["prompt_tokens"]
        bos = c.post("/v1/chat/completions", json=dict(body, add_special_tokens=True)).json()["usage"]["prompt_tokens"]
        assert bos == plain + 1
