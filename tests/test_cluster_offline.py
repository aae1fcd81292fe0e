"""``LLM(replicas=2)`` on the toy runtime: generate spread over two Ray replicas, the
same outputs as one engine gives, every replica used."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")

from superfluid import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    llm = LLM(runtime="toy", replicas=2)
    yield llm
    llm._cluster.close()
    ray.shutdown()


def test_generate_over_replicas_matches_one_engine(llm):
    prompts = [f"prompt number {i}: " + "abc " * (i % 5 + 3) for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    got = llm.generate(prompts, params)
    want = LLM(runtime="toy").generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in got)
    used = [r for r in llm._cluster.cluster.health()["replicas"] if sum(r["routed"].values())]
    assert len(used) == 2
