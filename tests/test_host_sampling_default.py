"""Host-side sampling on the default model (SmolLM2-135M-Instruct, the quantized
batch-invariant default path) through ``LLM``."""

from __future__ import annotations

import numpy as np
import pytest

from superfluid import LLM, SamplingParams

pytestmark = pytest.mark.slow  # loads the real model


@pytest.fixture(scope="module")
def llm():
    return LLM()


def top_k_1(output_ids, logits):
    keep = int(np.argmax(logits))
    out = np.full_like(logits, -np.inf)
    out[keep] = logits[keep]
    return out


PROMPTS = ["The capital of France is", "Three colours of the rainbow are"]


def test_top_k_1_processor_gives_the_greedy_text(llm):
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    hot = SamplingParams(temperature=1.3, seed=7, max_tokens=10)
    processed = llm.generate(PROMPTS, hot.with_(logits_processors=[top_k_1]))
    assert [o.outputs[0].text for o in processed] == [o.outputs[0].text for o in greedy]
    assert [o.outputs[0].text for o in llm.generate(PROMPTS, hot)] != [o.outputs[0].text for o in greedy]


def test_an_unchanging_processor_beside_engine_lanes_gives_the_engine_sampled_text(llm):
    p = SamplingParams(temperature=0.9, seed=3, max_tokens=10, logprobs=2)
    ref = llm.generate(PROMPTS, p)
    mixed = llm.generate(PROMPTS, [p.with_(logits_processors=[lambda ids, logits: logits]), p])
    assert [o.outputs[0].token_ids for o in mixed] == [o.outputs[0].token_ids for o in ref]
    for a, b in zip(mixed[0].outputs[0].logprobs, ref[0].outputs[0].logprobs):
        assert list(a) == list(b)
        assert [x.logprob for x in a.values()] == pytest.approx([x.logprob for x in b.values()], abs=1e-4)
