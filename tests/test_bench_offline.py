"""`bench offline` end to end on a tiny random GGUF (superfluid's torch runtime and transformers)."""

from __future__ import annotations

import json

import pytest

from superfluid.bench import cli
from superfluid.bench.offline import RESULT_KEYS, OfflineConfig, run_offline


def test_offline_toy_runtime_superfluid_only():
    r = run_offline(OfflineConfig(runtime="toy", num_prompts=4, output_len=8, max_prompt_tokens=200))
    assert set(RESULT_KEYS) <= set(r)
    assert r["superfluid"]["output_tokens"] == 4 * 8  # ignore_eos: exactly output_len each
    assert r["transformers"] is None and r["ratio"] is None  # no weights for transformers to load


def test_offline_against_transformers_on_a_tiny_gguf(tmp_path):
    pytest.importorskip("gguf")
    from superfluid_testing.tiny import TinyModel

    model = TinyModel().write_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "offline.json"
    rc = cli.main(["offline", "--model", str(model), "--num-prompts", "3", "--output-len", "6",
                   "--max-prompt-tokens", "48", "--hf-batch-size", "2", "--out", str(out)])
    assert rc == 0
    r = json.loads(out.read_text())
    assert r["superfluid"]["output_tokens"] == r["transformers"]["output_tokens"] == 18
    assert r["ratio"] == pytest.approx(r["superfluid"]["output_tokens_per_s"] / r["transformers"]["output_tokens_per_s"])
    assert 0.0 <= r["greedy_agreement"] <= 1.0
