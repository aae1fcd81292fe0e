"""sf_decode on the architectures of issue 26 it runs: q/k norms per head (Qwen3) and over
all heads (OLMoE), and mixture-of-experts feed-forwards (Qwen3-MoE, OLMoE, Mixtral) through
sf_experts. Each is held to the op-by-op description bit for bit (tests/test_whole_step.py's
steps), and sf_experts to decoder.experts (the Python loop over experts) on the same kernels."""

from __future__ import annotations

import pytest
import torch

from superfluid.runtimes.torch import TorchRuntime, kernels
from superfluid.runtimes.torch.decoder import experts
from superfluid.runtimes.torch.native import NativeKernels
from test_architectures import tok_dir, write_family  # noqa: F401 (tok_dir: a fixture)
from test_whole_step import assert_whole_step_is_op_by_op

FAMILIES = ["qwen3", "qwen3_moe", "olmoe", "mixtral"]

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="native kernels unavailable")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tok_dir):  # noqa: F811
    base = tmp_path_factory.mktemp("whole-step-families")
    return {f: write_family(f, base / f, tok_dir, seed=3) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_step_runs_the_family_as_the_description(folders, family, monkeypatch):
    for invariant in (True, False):
        rt = TorchRuntime(folders[family], kv_cache_mb=4, quant="q8_0", invariant=invariant)
        assert kernels.decoder_refusal(rt.model, rt.kv.k, rt.kv.v) is None
        assert_whole_step_is_op_by_op(rt, monkeypatch)


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])  # renormalised top weights, and not
def test_sf_experts_is_the_python_description_and_row_invariant(folders, family):
    rt = TorchRuntime(folders[family], kv_cache_mb=4, quant="q8_0")
    E = rt.model.layers[1].experts
    assert E.renormalise == (family == "qwen3_moe")
    h = torch.randn(37, rt.cfg.hidden, generator=torch.Generator().manual_seed(5))
    got = kernels.experts(h, E)

    class Loop(NativeKernels):  # the description's loop over experts on the same native kernels
        def experts(self, h, E, activation):
            return experts(self, h, E, activation)

    want = experts(Loop(rt.model, meta=None), h, E, "silu")
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    for rows in (slice(0, 1), slice(3, 4), slice(10, 19)):  # a row's result: that row's alone
        assert torch.equal(kernels.experts(h[rows].contiguous(), E), got[rows])
    routed = torch.topk(torch.softmax(kernels.gemv(h, E.router.q), -1), E.used).indices
    assert len(torch.unique(routed)) == len(E.wgu)  # every expert had rows here


def test_sf_experts_refuses_bad_shapes(folders):
    rt = TorchRuntime(folders["mixtral"], kv_cache_mb=4, quant="q8_0")
    E = rt.model.layers[0].experts
    with pytest.raises(ValueError, match="sf_experts"):
        kernels.experts(torch.randn(3, rt.cfg.hidden + 32), E)
