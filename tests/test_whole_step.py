"""kernels.c's sf_decode (the whole step in one C call) against the one description of the
layer (decoder.layer on native.NativeKernels, op by op), on every architecture feature the
Llama family has: q/k/v biases (Qwen2), a sliding window (Mistral), RoPE scaling (linear,
llama3 as llama.cpp's rope_freqs, YaRN); and the refusal that sends a model sf_decode cannot
run to the op-by-op route."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from superfluid.runtimes.base import Feed
from superfluid.runtimes.torch import TorchRuntime, kernels, native
from superfluid.runtimes.torch.config import ModelConfig
from superfluid.runtimes.torch.kernels import QMat
from superfluid_testing.tiny import TinyModel

WINDOW = 8
PROMPT = np.random.default_rng(11).integers(3, 260, 24).tolist()  # decoded past WINDOW
FEATURES = {  # name -> TinyModel fields
    "plain": {},
    "bias": {"arch": "qwen2"},
    "window": {"meta": {"attention.sliding_window": WINDOW}},
    "rope_linear": {"meta": {"rope.scaling.type": "linear", "rope.scaling.factor": 4.0}},
    "rope_llama3": {"shapes": {"rope_freqs.weight": (8,)}},  # per-frequency divisors (head_dim 16)
    "rope_yarn": {"meta": {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                           "rope.scaling.original_context_length": 8, "rope.scaling.yarn_beta_fast": 16.0}},
}

pytestmark = pytest.mark.skipif(kernels.native() is None, reason="native kernels unavailable")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("whole_step")
    return {name: TinyModel(**kw).write_gguf(d / f"{name}.gguf") for name, kw in FEATURES.items()}


def decode_steps(rt) -> np.ndarray:
    """Rows [24, 2, V] of two lanes fed one token a step together (decode-only steps)."""
    a, b = rt.seq_create(), rt.seq_create()
    rows = [np.stack(rt.step([Feed(a, [x], True), Feed(b, [y], True)])) for x, y in zip(PROMPT, PROMPT[::-1])]
    rt.seq_free(a)
    rt.seq_free(b)
    return np.stack(rows)


def mixed_step(rt) -> np.ndarray:
    """Every row of one step holding a prefill chunk (positions 6..16, across the window)
    beside a decode: whole-step on the invariant route, op by op otherwise."""
    a, b = rt.seq_create(), rt.seq_create()
    rt.step([Feed(a, PROMPT[:6], False), Feed(b, PROMPT[:13], False)])
    rows = rt.step_rows([Feed(a, PROMPT[6:17], True), Feed(b, PROMPT[13:14], True)])
    rt.seq_free(a)
    rt.seq_free(b)
    return np.concatenate([np.stack(r) for r in rows])


def assert_whole_step_is_op_by_op(rt, monkeypatch) -> None:
    """sf_decode runs rt's decode and mixed steps, with the rows op by op gives."""
    whole = decode_steps(rt), mixed_step(rt)
    assert rt.model.native_decoder[1] is not None  # sf_decode ran those steps
    monkeypatch.setattr(native, "WHOLE_STEP", False)
    np.testing.assert_array_equal(decode_steps(rt), whole[0])
    np.testing.assert_array_equal(mixed_step(rt), whole[1])
    monkeypatch.setattr(native, "WHOLE_STEP", True)


@pytest.mark.parametrize("quant", ["q8_0", "q4_1"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_whole_step_equals_the_layer_description(models, feature, quant, monkeypatch):
    for invariant in (True, False):
        assert_whole_step_is_op_by_op(TorchRuntime(models[feature], kv_cache_mb=4, quant=quant, invariant=invariant),
                                      monkeypatch)


def test_the_features_are_on(models):
    cfg = {name: TorchRuntime(p, kv_cache_mb=4, quant="q8_0").cfg for name, p in models.items()}
    assert cfg["bias"].attention_bias and cfg["window"].sliding_window == WINDOW
    assert cfg["rope_linear"].rope_scaling.kind == "linear" and cfg["rope_yarn"].rope_scaling.kind == "yarn"
    plain = TorchRuntime(models["plain"], kv_cache_mb=4, quant="q8_0").model
    llama3 = TorchRuntime(models["rope_llama3"], kv_cache_mb=4, quant="q8_0").model
    assert not np.array_equal(plain.cos.numpy(), llama3.cos.numpy())


@pytest.mark.parametrize("feature", [f for f in FEATURES if f != "plain"])
def test_native_route_follows_the_reference_on_each_feature(models, feature):
    """The quantized rows stay near the fp32 reference of the same model, nearer than the
    reference without the feature is: the native route computes the feature, it does not
    just run."""
    ref = decode_steps(TorchRuntime(models[feature], dtype="float32", quant="none", kv_cache_mb=4))
    got = decode_steps(TorchRuntime(models[feature], kv_cache_mb=4, quant="q8_0"))
    assert np.abs(got - ref).max() / np.abs(ref).max() < 0.05
    if feature != "bias":  # qwen2's file draws other weights too: no same-weights model without the feature
        without = decode_steps(TorchRuntime(models["plain"], dtype="float32", quant="none", kv_cache_mb=4))
        assert np.abs(got - ref).max() < 0.5 * np.abs(without - ref).max()


def test_a_feature_sf_decode_lacks_is_refused_and_steps_go_op_by_op(models):
    """A config field sf_decode does not know (a future option here, as a new feature would arrive)
    is refused by name; the runtime then steps op by op, and Decoder will not build."""

    @dataclasses.dataclass(frozen=True)
    class WithFuture(ModelConfig):
        future_option: bool = False

    rt = TorchRuntime(models["plain"], kv_cache_mb=4, quant="q8_0")
    whole = decode_steps(rt)
    model = rt.model
    assert kernels.decoder_refusal(model, rt.kv.k, rt.kv.v) is None
    fields = {f.name: getattr(model.cfg, f.name) for f in dataclasses.fields(model.cfg)}
    model.cfg = WithFuture(**fields, future_option=False)
    assert kernels.decoder_refusal(model, rt.kv.k, rt.kv.v) is None  # known-off is no feature
    model.cfg = WithFuture(**fields, future_option=True)
    model.native_decoder = None
    assert "future_option" in kernels.decoder_refusal(model, rt.kv.k, rt.kv.v)
    with pytest.raises(ValueError, match="future_option"):
        kernels.Decoder(model, rt.kv.k, rt.kv.v)
    np.testing.assert_array_equal(decode_steps(rt), whole)  # op by op: the same rows
    assert model.native_decoder[1] is None


def test_mixed_kinds_run_in_the_whole_step_as_op_by_op(models, monkeypatch):
    """A Q4_K_M-like mix (one layer's down matrix in another kind, a fused qkv stacked from
    parts of two kinds) still runs in sf_decode, each matrix on its own kernel, with the
    rows op by op gives."""
    from superfluid.runtimes.torch.qmat import QCat

    rt = TorchRuntime(models["plain"], kv_cache_mb=4, quant="q8_0")
    uniform = decode_steps(rt)
    L0, L1 = rt.model.layers[0], rt.model.layers[1]
    L1.wdown.q = QMat(L1.wdown.w, "q4_1")
    n = L0.wqkv.w.shape[0] - 2 * rt.cfg.n_kv_heads * rt.cfg.head_dim  # q rows in q8_0, k and v in q4_1
    L0.wqkv.q = QCat([QMat(L0.wqkv.w[:n], "q8_0"), QMat(L0.wqkv.w[n:], "q4_1")])
    rt.model.native_decoder = None
    assert kernels.decoder_refusal(rt.model, rt.kv.k, rt.kv.v) is None
    whole = decode_steps(rt)
    assert rt.model.native_decoder[1] is not None
    monkeypatch.setattr(native, "WHOLE_STEP", False)
    np.testing.assert_array_equal(decode_steps(rt), whole)
    assert not np.array_equal(whole, uniform)  # the q4_1 matrices are used
    assert np.abs(whole - uniform).max() / np.abs(uniform).max() < 0.25
