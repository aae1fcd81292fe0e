"""``superfluid serve --runtime llamacpp`` on tiny random GGUFs (a Llama, a Mamba, a Mamba2,
a hybrid Jamba),
driven by the openai client: greedy text equals transformers', the OpenAI surface, exact
prefix caching of resent prompts and next turns (Mamba: checkpoints at prompt end - 1),
and files that do not load failing before the server says healthy."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("llama_cpp")
openai = pytest.importorskip("openai")

import torch  # noqa: E402

from serve_helpers import Server  # noqa: E402
from superfluid_testing.tiny_mamba import write_tiny_jamba, write_tiny_mamba, write_tiny_mamba2  # noqa: E402
from superfluid_testing.tiny import TinyModel  # noqa: E402
from superfluid.tokenizer import Tokenizer  # noqa: E402

PROMPT = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]
LONG = "the theory of everything is an interesting one, " * 4  # > 128 tokens: worth a checkpoint


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lcserve")
    mamba, mamba_hf = write_tiny_mamba(d / "m", seed=1)
    mamba2, mamba2_hf = write_tiny_mamba2(d / "m2", seed=2)
    jamba, jamba_hf = write_tiny_jamba(d / "j", seed=3)
    return {"dir": d, "llama": TinyModel(tied=False, seed=4).write_gguf(d / "llama.gguf"), "mamba": mamba,
            "mamba_hf": mamba_hf, "mamba2": mamba2, "mamba2_hf": mamba2_hf, "jamba": jamba, "jamba_hf": jamba_hf}


@pytest.fixture(scope="module", params=["llama", "mamba", "mamba2", "jamba"])
def served(request, files):
    server = Server("--model", str(files[request.param]), "--runtime-arg", "n_threads=1", "--runtime-arg", "kv_f32=true",
                    runtime="llamacpp")
    client = openai.OpenAI(base_url=server.v1, api_key="none", max_retries=0, timeout=120)
    yield request.param, server, client, str(files[request.param])  # the model id is the path served
    server.cleanup()


def _transformers_greedy(name, files, n):
    from transformers import AutoModelForCausalLM, JambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM

    if name == "mamba":
        hf = MambaForCausalLM.from_pretrained(files["mamba_hf"], dtype=torch.float32).eval()
    elif name == "mamba2":
        hf = Mamba2ForCausalLM.from_pretrained(files["mamba2_hf"], dtype=torch.float32).eval()
    elif name == "jamba":
        hf = JambaForCausalLM.from_pretrained(files["jamba_hf"], dtype=torch.float32).eval()
    else:
        hf = AutoModelForCausalLM.from_pretrained(files["dir"], gguf_file="llama.gguf", dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))
    return out[0, len(PROMPT):].tolist()


def test_greedy_text_equals_transformers(served, files):
    name, server, client, model = served
    assert [m.id for m in client.models.list().data] == [model]
    assert server.health()["status"] == "ok"
    want = _transformers_greedy(name, files, 10)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1)
    tok = Tokenizer.from_gguf(files[name])
    assert r.choices[0].text == tok.decode(want)
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(PROMPT)


def test_openai_surface(served):
    name, server, client, model = served
    msgs = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    text, usage = "", None
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage:
            usage = chunk.usage
    assert text == whole.choices[0].message.content and usage.completion_tokens == whole.usage.completion_tokens
    kw = dict(model=model, messages=msgs, max_tokens=8, temperature=1.0, n=2, seed=11)
    a = [c.message.content for c in client.chat.completions.create(**kw).choices]
    b = [c.message.content for c in client.chat.completions.create(**kw).choices]
    assert a == b and a[0] != a[1]
    lp = client.chat.completions.create(model=model, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=3)
    for item in lp.choices[0].logprobs.content:
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0, logprobs=True)
    first = bytes(plain.choices[0].logprobs.content[0].bytes)
    tok = Tokenizer.from_gguf(model)
    (banned,) = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == first][:1]
    biased = client.chat.completions.create(model=model, messages=msgs, max_tokens=1, temperature=0, logprobs=True,
                                            logit_bias={str(banned): -100})
    assert bytes(biased.choices[0].logprobs.content[0].bytes) != first
    stopped = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0)
    cut = stopped.choices[0].text[3:6]
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0, stop=[cut])
    assert r.choices[0].text == stopped.choices[0].text[: stopped.choices[0].text.index(cut)]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[10**6], max_tokens=2)


def test_resent_prompt_and_next_turn_are_cached(served):
    name, server, client, model = served
    msgs = [{"role": "user", "content": LONG}]
    first = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    again = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    n = first.usage.prompt_tokens
    # at most the chat template's header, which the fixture's earlier requests shared (page 1)
    assert n > 128 and first.usage.prompt_tokens_details.cached_tokens < 16
    cached = again.usage.prompt_tokens_details.cached_tokens
    if name != "llama":  # recurrent or hybrid: exact_only
        assert cached == n - 1  # the exact checkpoint one token short of the prompt's end
    else:
        assert cached == n  # page 1: the whole prompt (its last token is held back for the first decode)
    assert again.choices[0].message.content == first.choices[0].message.content
    turn2 = msgs + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and then?"}]
    nxt = client.chat.completions.create(model=model, messages=turn2, max_tokens=8, temperature=0)
    assert nxt.usage.prompt_tokens_details.cached_tokens >= (n - 1 if name != "llama" else n)
    fresh = Server("--model", str(server.cmd[server.cmd.index("--model") + 1]), "--runtime-arg", "n_threads=1",
                   "--runtime-arg", "kv_f32=true", "--no-prefix-cache", runtime="llamacpp")
    try:
        c2 = openai.OpenAI(base_url=fresh.v1, api_key="none", max_retries=0, timeout=120)
        ref = c2.chat.completions.create(model=model, messages=turn2, max_tokens=8, temperature=0)
        assert ref.usage.prompt_tokens_details.cached_tokens == 0
        assert ref.choices[0].message.content == nxt.choices[0].message.content  # the cache changed no text
    finally:
        fresh.cleanup()


# ------------------------------------------------------------------ bad files


def _bad_files(d, good):
    data = good.read_bytes()
    cut = d / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    arch, _ = write_tiny_mamba(d / "arch", arch="mamba9")
    return {
        "unknown architecture": (arch, "mamba9"),
        "truncated": (cut, "not a readable GGUF"),
        "vocabulary mismatch": (TinyModel(shapes={"token_embd.weight": (200, 64)}, tied=False).write_gguf(d / "vocab.gguf"),
                                "token_embd"),
        # 3 KV heads for 4 query heads: llama.cpp aborts the process (GGML_ASSERT) while loading
        "abort": (TinyModel(n_kv_heads=3).write_gguf(d / "abort.gguf"), "died while loading"),
    }


def test_bad_files_fail_before_healthy(files, tmp_path):
    for what, (path, why) in _bad_files(tmp_path, files["llama"]).items():
        with pytest.raises(RuntimeError) as e:
            Server("--model", str(path), "--runtime-arg", "n_threads=1", runtime="llamacpp", ready_timeout=120)
        msg = str(e.value)
        assert "exited with 2" in msg and str(path) in msg and why in msg, (what, msg[-2000:])


# ------------------------------------------------------------------ failures


def _greedy_texts(client, model, n_req=4, max_tokens=40):
    import concurrent.futures as cf

    prompts = [PROMPT[i:] + PROMPT[:i] for i in range(n_req)]

    def one(p):
        return client.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text

    with cf.ThreadPoolExecutor(n_req) as pool:
        return list(pool.map(one, prompts))


@pytest.mark.parametrize("name", ["llama", "mamba"])
def test_fatal_decode_exits_70_and_replays_to_the_same_text(files, name):
    """A Fatal from the runtime (as llama_decode < 0 raises; here in a decode step, which samples
    in the runtime) ends the worker with 70; the daemon starts a clean one and decode-replays
    every request to the text it would have had."""
    model = str(files[name])
    # No drafts: a drafted round verifies through step_rows, and the gate's timing decides how
    # many rounds draft, so the failure is placed by step_sampled's call count without them.
    args = ("--model", model, "--runtime-arg", "n_threads=1", "--runtime-arg", "kv_f32=true", "--no-speculative")
    ref_server = Server(*args, runtime="llamacpp")
    try:
        want = _greedy_texts(openai.OpenAI(base_url=ref_server.v1, api_key="x", max_retries=0), model)
    finally:
        ref_server.cleanup()
    server = Server(*args, runtime="llamacpp", env={"SUPERFLUID_FAIL_RUNTIME": "step_sampled:fatal:1:30"})
    try:
        got = _greedy_texts(openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=120), model)
        for _ in range(100):  # the replacement may still be settling (degraded) as the last reply lands
            h = server.health()
            if h["status"] == "ok":
                break
            time.sleep(0.1)
        assert h["restarts"] >= 1 and h["last_exit"] == 70 and h["status"] == "ok", h
    finally:
        server.cleanup()
    assert got == want


def test_a_full_kv_preempts_and_every_request_completes(files):
    """256 cells for 6 requests of 20 + 60 tokens: llama_decode runs out of KV slots (Capacity,
    the lane's OOM_TENTATIVE fault), the scheduler preempts and resumes; nothing is lost."""
    model = str(files["llama"])
    server = Server("--model", model, "--runtime-arg", "n_threads=1", "--runtime-arg", "kv_f32=true",
                    "--runtime-arg", "n_ctx=256", runtime="llamacpp")
    try:
        client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=300)
        got = _greedy_texts(client, model, n_req=6, max_tokens=60)
        assert all(len(t) > 0 for t in got)
        assert server.health()["restarts"] == 0
        solo = [client.completions.create(model=model, prompt=PROMPT[i:] + PROMPT[:i], max_tokens=60, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for i in range(6)]
        assert got == solo
    finally:
        server.cleanup()
