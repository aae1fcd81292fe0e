"""In-runtime sampling on the llamacpp runtime (``step_sampled``) gives exactly the tokens of
the host path (``step`` rows picked by superfluid/sampling.py): greedy and seeded draws,
several lanes per step, a Llama and a Mamba; then the same through the executor, whose
decode rounds take ``step_sampled`` when ``desc.engine_sampling`` is on. Two runtimes
of one file fed the same batches give bitwise the same rows, so tokens must be equal,
not close. Fast: tiny random GGUFs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

import llama_cpp as L  # noqa: E402

from lane_driver import Driver, LaneRun  # noqa: E402
from superfluid.abi import Sampling, SamplingFlag, LaneParams  # noqa: E402
from superfluid.executor import Executor  # noqa: E402
from superfluid import sampling as hs  # noqa: E402
from superfluid.runtimes.base import Feed, SampleSpec  # noqa: E402
from superfluid.runtimes.llamacpp.runtime import LlamaCppRuntime  # noqa: E402
from superfluid_testing.tiny_mamba import write_tiny_mamba  # noqa: E402
from superfluid_testing.tiny import TinyModel  # noqa: E402

PROMPT = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]
SPECS = [SampleSpec(0.0, 0, 1.0, 0.0, 0), SampleSpec(0.8, 0, 0.95, 0.0, 12345), SampleSpec(1.3, 20, 1.0, 0.05, 999),
         SampleSpec(0.5, 5, 0.5, 0.0, 7), SampleSpec(0.0, 0, 1.0, 0.0, 3), SampleSpec(2.0, 0, 1.0, 0.0, 1 << 40),
         SampleSpec(1.0, 1, 1.0, 0.0, 5), SampleSpec(0.7, 50, 0.9, 0.1, 77)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lcsample")
    return {"llama": TinyModel(tied=False, seed=4).write_gguf(d / "llama.gguf"),
            "mamba": write_tiny_mamba(d / "mamba", seed=1)[0]}


def _pair(path):
    kw = dict(n_threads=1, max_batch=8, n_ctx=512)
    return LlamaCppRuntime(path, **kw), LlamaCppRuntime(path, **kw)


def _host(row: np.ndarray, s: SampleSpec) -> int:
    if s.temperature <= 0.0:
        return hs.argmax(row)
    return hs.sample(row, LaneParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p),
                     hs.uniform(s.rng_position))


@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_step_sampled_gives_the_host_tokens(files, kind):
    ours, host = _pair(files[kind])
    assert ours.desc.engine_sampling and ours.desc.engine_draws
    seqs = [(ours.seq_create(), host.seq_create()) for _ in SPECS]
    # Prompts of different lengths in one batch; no rows wanted (step_sampled still samples every feed).
    first = [Feed(a, PROMPT[i: i + 4 + i], False) for i, (a, _) in enumerate(seqs)]
    specs = list(SPECS)
    toks = ours.step_sampled(first, specs)
    rows = host.step([Feed(b, f.tokens, True) for f, (_, b) in zip(first, seqs)])
    assert toks == [_host(r, s) for r, s in zip(rows, specs)]
    off_argmax = 0  # draws that left the argmax: the sampled lanes really sample
    for _ in range(6):  # decode steps: each lane feeds back its token, its draw moves on
        specs = [dataclasses.replace(s, rng_position=s.rng_position + 1) for s in specs]
        rows = host.step([Feed(b, [t], True) for t, (_, b) in zip(toks, seqs)])
        got = ours.step_sampled([Feed(a, [t], True) for t, (a, _) in zip(toks, seqs)], specs)
        want = [_host(r, s) for r, s in zip(rows, specs)]
        assert got == want
        off_argmax += sum(t != hs.argmax(r) for t, r in zip(got, rows))
        toks = got
    assert off_argmax >= 3
    assert [ours.seq_len(a) for a, _ in seqs] == [host.seq_len(b) for _, b in seqs]
    ours.close()
    host.close()


def test_step_rows_come_back_in_feed_order(files):
    """step() reads every wanted row from one view of llama_get_logits: each must be the
    row llama.cpp names for its batch index (llama_get_logits_ith)."""
    rt, _ = _pair(files["llama"])
    seqs = [rt.seq_create() for _ in range(4)]
    feeds = [Feed(s, PROMPT[: 3 + 2 * i], i != 1) for i, s in enumerate(seqs)]
    rows = rt.step(feeds)
    ends = np.cumsum([len(f.tokens) for f in feeds]) - 1
    V = rt.desc.vocab_size
    for row, end in zip(rows, [e for e, f in zip(ends, feeds) if f.wants_row]):
        ref = np.ctypeslib.as_array(L.llama_get_logits_ith(rt._ctx, int(end)), shape=(V,))
        np.testing.assert_array_equal(row, ref)
    rt.step([Feed(s, [1], True) for s in seqs])  # the next decode overwrites llama.cpp's buffer...
    assert not np.array_equal(rows[0], rows[1])  # ...not the rows step() returned
    rt.close()


class Counting:
    """A runtime that counts which step primitive the executor used."""

    def __init__(self, rt, engine_sampling: bool):
        self.rt = rt
        self.desc = dataclasses.replace(rt.desc, engine_sampling=engine_sampling, engine_draws=engine_sampling)
        self.calls = {"step": 0, "step_sampled": 0}

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def step(self, feeds):
        self.calls["step"] += 1
        return self.rt.step(feeds)

    def step_sampled(self, feeds, specs):
        self.calls["step_sampled"] += 1
        return self.rt.step_sampled(feeds, specs)


def _runs() -> list[LaneRun]:
    """Greedy and seeded lanes, side by side (EOS ignored: every lane runs its 24 tokens)."""
    seeded = LaneParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, flags=SamplingFlag.IGNORE_EOS)
    hot = LaneParams(temperature=1.5, flags=SamplingFlag.IGNORE_EOS)
    greedy = LaneParams(flags=SamplingFlag.IGNORE_EOS)
    modes = [(Sampling.GREEDY, greedy), (Sampling.SAMPLE, seeded), (Sampling.SAMPLE, hot),
             (Sampling.GREEDY, greedy), (Sampling.SAMPLE, seeded)]
    return [LaneRun(i + 1, PROMPT[i:] + PROMPT[:i], 24, sampling=m, params=p, rounds=3, rng_base=77 + i)
            for i, (m, p) in enumerate(modes)]


@pytest.mark.parametrize("kind", ["llama", "mamba"])
def test_executor_lanes_same_tokens_sampled_in_the_runtime_or_on_the_host(files, kind):
    a, b = _pair(files[kind])
    ours, host = Counting(a, engine_sampling=True), Counting(b, engine_sampling=False)
    outs = []
    for rt in (ours, host):
        d = Driver(Executor(rt))
        runs = [d.add(r) for r in _runs()]
        d.run()
        outs.append([r.out for r in runs])
    assert outs[0] == outs[1]
    assert all(len(o) == 24 for o in outs[0])
    assert ours.calls["step_sampled"] > 0 and host.calls["step_sampled"] == 0
    a.close()
    b.close()
