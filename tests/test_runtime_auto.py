"""``--runtime auto``, the default (issue 26): torch where it runs the file's architecture
and tensor types, llamacpp otherwise, said at start and in /health; ``--runtime torch`` on
an architecture it does not run names the architecture and the runtime that does."""

from __future__ import annotations

import json

import httpx
import pytest
from gguf import GGMLQuantizationType as Q

from serve_helpers import Server
from superfluid.models import ModelLoadError
from superfluid.runtimes.auto import pick_runtime
from superfluid_testing.tiny_mamba import write_tiny_mamba
from superfluid_testing.tiny import TinyModel


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("auto")
    mamba, _ = write_tiny_mamba(d / "m", seed=1)
    hf = d / "gemma"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    return {"llama": TinyModel(seed=4).write_gguf(d / "llama.gguf"), "mamba": mamba,
            "iq": TinyModel(seed=4, raw_types={"blk.0.ffn_down.weight": Q.IQ4_NL}).write_gguf(d / "iq.gguf"),
            "gemma_hf": hf}


def test_the_pick_and_its_reason(files):
    assert pick_runtime("SmolLM2-135M-Instruct") == ("torch", "torch runs llama with this file's tensor types")
    assert pick_runtime(files["llama"])[0] == "torch"
    kind, why = pick_runtime(files["mamba"])
    assert kind == "llamacpp" and "architecture 'mamba' is not one torch runs" in why
    kind, why = pick_runtime(files["iq"])
    assert kind == "llamacpp" and "IQ4_NL" in why
    with pytest.raises(ModelLoadError, match="falcon.*GGUF files only"):
        pick_runtime(files["gemma_hf"])


def test_serve_with_no_runtime_flag_runs_a_mamba_file_on_llamacpp_and_says_why(files):
    server = Server("--model", str(files["mamba"]), "--runtime-arg", "n_threads=1", runtime="auto")
    try:
        health = server.health()
        assert health["runtime"].startswith("llamacpp"), health
        assert "architecture 'mamba'" in health["runtime_reason"]
        assert "on the llamacpp runtime (auto: architecture 'mamba'" in server.log()
        r = httpx.post(server.v1 + "/completions", json={"model": str(files["mamba"]), "prompt": [5, 77, 130],
                                                         "max_tokens": 4, "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    finally:
        server.cleanup()


def test_runtime_torch_on_an_architecture_it_does_not_run_names_the_one_that_does(files):
    with pytest.raises(RuntimeError, match=r"does not run architecture 'mamba'.*the llamacpp runtime does"):
        Server("--model", str(files["mamba"]), runtime="torch", ready_timeout=120)
