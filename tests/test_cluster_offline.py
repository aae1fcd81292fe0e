"""``LLM(replicas=2)`` on the toy runtime: generate spread over two Ray replicas, the
same outputs as one engine gives, every replica used.

The check runs in a subprocess of its own: Ray, once initialised in a process, leaves
state behind after ``ray.shutdown()`` that changes how later tests in the same pytest
process see exceptions (the GGUF loader fuzz test failed after this one, never alone)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

SCRIPT = r"""
import ray
from superfluid import LLM, SamplingParams

llm = LLM(runtime="toy", replicas=2)
try:
    prompts = [f"prompt number {i}: " + "abc " * (i % 5 + 3) for i in range(12)]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    got = llm.generate(prompts, params)
    want = LLM(runtime="toy").generate(prompts, params)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in got)
    used = [r for r in llm._cluster.cluster.health()["replicas"] if sum(r["routed"].values())]
    assert len(used) == 2, used
finally:
    llm.close()
    ray.shutdown()
print("ok")
"""


def test_generate_over_replicas_matches_one_engine():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout[-3000:] + p.stderr[-3000:]
