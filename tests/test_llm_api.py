"""``LLM`` at vLLM's level, on the toy runtime: prompt forms, params per prompt,
progress bars, batched chat, the tokenizer, and the model in a worker process."""

from __future__ import annotations

import pytest

from superfluid import LLM, SamplingParams

P = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM(runtime="toy")


def ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prompt_forms_give_the_same_outputs(llm):
    tok = llm.get_tokenizer()
    ids = tok.encode("the same prompt")
    by_text = llm.generate(["the same prompt"], sampling_params=P)
    forms = [
        llm.generate("the same prompt", P),
        llm.generate(ids, P),
        llm.generate([{"prompt": "the same prompt"}], P),
        llm.generate({"prompt_token_ids": ids}, P),
        llm.generate(prompt_token_ids=ids, sampling_params=P),
        llm.generate(prompt_token_ids=[ids, ids], sampling_params=P)[:1],
        llm.generate(["the same prompt"], params=P),  # the earlier keyword
    ]
    for got in forms:
        assert ids_of(got) == ids_of(by_text)
        assert got[0].prompt_token_ids == ids
    assert llm.generate({"prompt_token_ids": ids}, P)[0].prompt is None
    with pytest.raises(ValueError, match="not both"):
        llm.generate(["x"], P, prompt_token_ids=ids)


def test_one_params_per_prompt_and_priorities(llm):
    outs = llm.generate(["a", "b"], [P.with_(max_tokens=2), P.with_(max_tokens=5)], priority=[1, 0])
    assert [len(i) for i in ids_of(outs)] == [2, 5]
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(["a", "b"], [P])
    with pytest.raises(ValueError, match="one priority per prompt"):
        llm.generate(["a", "b"], P, priority=[1])


def test_a_bad_prompt_refuses_the_whole_call_and_leaves_nothing_queued(llm):
    with pytest.raises(ValueError):
        llm.generate([[1, 2], [10_000]], P)
    assert not llm.engine.has_work()
    assert len(ids_of(llm.generate([[1, 2]], P))[0]) == 6


class FakeBar:
    made: list["FakeBar"] = []

    def __init__(self, total, **kw):
        self.total, self.n, self.closed = total, 0, False
        FakeBar.made.append(self)

    def update(self, k):
        self.n += k

    def close(self):
        self.closed = True


def test_use_tqdm_counts_finished_prompts_and_is_on_by_default_for_many(llm, capsys):
    llm.generate([f"p{i}" for i in range(7)], P, use_tqdm=FakeBar)
    bar = FakeBar.made[-1]
    assert (bar.total, bar.n, bar.closed) == (7, 7, True)
    llm.generate([f"p{i}" for i in range(7)], P)  # the default: a real tqdm bar on stderr
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["one", "two"], P)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate([f"p{i}" for i in range(7)], P, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_chat_over_a_batch_of_conversations(llm):
    convs = [[{"role": "user", "content": "hi"}], [{"role": "system", "content": "be brief"}, {"role": "user", "content": "yo"}]]
    outs = llm.chat(convs, [P, P.with_(max_tokens=3)], use_tqdm=False)
    assert [len(i) for i in ids_of(outs)] == [6, 3]
    tok = llm.get_tokenizer()
    for conv, out in zip(convs, outs):
        assert out.prompt == tok.apply_chat_template(conv, add_generation_prompt=True)
    single = llm.chat(convs[0], P)
    assert ids_of(single) == ids_of(outs[:1])


def test_worker_process_gives_the_same_text_as_in_process(llm):
    p = SamplingParams(temperature=0.7, seed=1, max_tokens=12, n=2, ignore_eos=True)
    ref = llm.generate(["in a worker"], p)
    with LLM(runtime="toy", worker=True) as w:
        pid = w.engine.model_pid
        import os

        assert pid != os.getpid()
        got = w.generate(["in a worker"], p)
        assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in ref[0].outputs]
        got = w.generate(["in a worker"], p.with_(logits_processors=[lambda ids, logits: logits]))
        assert [c.token_ids for c in got[0].outputs] == [c.token_ids for c in ref[0].outputs]
    assert w.engine.ex.state == "stopped"
