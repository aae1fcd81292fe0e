"""best_of ranking and fill-in-the-middle prompts, without a model."""

from __future__ import annotations

import pytest

from superfluid.engine.outputs import Logprob
from superfluid.engine.params import ParamError
from superfluid.server.completion_extras import Extras, fim_prompt
from superfluid.server.render import Choice


def choice(i: int, lps: list[float]) -> Choice:
    c = Choice(i, text=f"c{i}", token_ids=list(range(len(lps))))
    c.logprobs = [{t: Logprob(v, 1)} for t, v in enumerate(lps)]
    return c


def test_best_of_keeps_the_n_best_per_prompt_in_order():
    ex = Extras(n=2, best_of=3, echo=False, client_logprobs=None)
    got = ex.select([choice(0, [-1.0]), choice(1, [-0.1, -0.1]), choice(2, [-3.0]),
                     choice(3, [-2.0]), choice(4, [-0.5]), choice(5, [-0.7])], n_prompts=2)
    assert [(c.index, c.text) for c in got] == [(0, "c1"), (1, "c0"), (2, "c4"), (3, "c5")]


class _Backend:
    def __init__(self, vocab):
        self.vocab = vocab

    def token_to_id(self, t):
        return self.vocab.get(t)


class _Tok:
    def __init__(self, vocab):
        self.backend = _Backend(vocab)


def test_fim_prompt_where_the_vocabulary_has_fim_tokens():
    qwen = _Tok({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3})
    assert fim_prompt(qwen, "def f(", "    return x\n") == "<|fim_prefix|>def f(<|fim_suffix|>    return x\n<|fim_middle|>"
    star = _Tok({"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3})
    assert fim_prompt(star, "a", "b") == "<fim_prefix>a<fim_suffix>b<fim_middle>"
    with pytest.raises(ParamError) as e:
        fim_prompt(_Tok({"<fim_prefix>": 1}), "a", "b")
    assert e.value.param == "suffix"
    with pytest.raises(ParamError):
        fim_prompt(star, [1, 2], "b")
