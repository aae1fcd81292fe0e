"""The executor's stateful property tests (test_executor_properties.py) over the llamacpp
runtime on tiny random GGUFs: a Llama (paged prefix cache, shared cells, a tight pool whose
full KV faults lanes OOM_TENTATIVE), a Mamba (exact_only: checkpoints, whole copies,
take-overs) and a hybrid Jamba (exact_only over a counted, tight KV pool). Fewer examples than on the toy: each one loads a model.

The machine checks the runtime through the toy's introspection (``seqs``, ``snapshot``,
``cells_of_live_seqs``); ``Tracked`` provides it over the real runtime: token histories it
records as the primitives succeed, llama.cpp's own last positions (which must equal the
lengths), and the cell ledger. Rows are compared with a fresh prefill on a second context:
llama.cpp's rows depend on the batch shape in the last bits, so within a tolerance, and a
greedy token must be a top token of that row.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import settings

pytest.importorskip("llama_cpp")

import test_executor_properties as P  # noqa: E402
from superfluid.runtimes.base import Feed  # noqa: E402
from superfluid.runtimes.llamacpp.runtime import LlamaCppRuntime  # noqa: E402
from superfluid_testing.tiny_mamba import write_tiny_jamba, write_tiny_mamba  # noqa: E402
from superfluid_testing.tiny import TinyModel  # noqa: E402

ROW_ATOL = 2e-3


class Tracked:
    """A LlamaCppRuntime with the toy's test introspection; every other attribute passes through."""

    def __init__(self, rt: LlamaCppRuntime):
        self.rt = rt
        self.hist: dict[int, list[int]] = {}

    def __getattr__(self, name):
        return getattr(self.rt, name)

    def seq_create(self) -> int:
        seq = self.rt.seq_create()
        self.hist[seq] = []
        return seq

    def seq_copy(self, src, dst, n):
        self.rt.seq_copy(src, dst, n)
        self.hist[dst] = self.hist[src][:n]

    def seq_truncate(self, seq, n):
        self.rt.seq_truncate(seq, n)
        del self.hist[seq][n:]

    def seq_free(self, seq):
        self.rt.seq_free(seq)
        self.hist.pop(seq, None)

    def seq_export(self, seq):
        return {"inner": self.rt.seq_export(seq), "tokens": list(self.hist[seq])}

    def seq_import(self, seq, payload):
        n = self.rt.seq_import(seq, payload["inner"])
        self.hist[seq] = list(payload["tokens"])
        return n

    def _ingested(self, feeds):
        for f in feeds:
            self.hist[f.seq] += list(f.tokens)

    def step(self, feeds):
        out = self.rt.step(feeds)
        self._ingested(feeds)
        return out

    def step_rows(self, feeds):
        out = self.rt.step_rows(feeds)
        self._ingested(feeds)
        return out

    def step_sampled(self, feeds, specs):
        out = self.rt.step_sampled(feeds, specs)
        self._ingested(feeds)
        return out

    # ---- the toy's introspection
    @property
    def seqs(self):
        return {s: SimpleNamespace(tokens=list(h), state=(0, 0, len(h))) for s, h in self.hist.items()}

    def snapshot(self) -> tuple:
        lens = tuple(sorted((s, tuple(h), self.rt.pos_max(s)) for s, h in self.hist.items()))
        ledger = self.rt.ledger
        cells = None if ledger is None else (ledger.refs.tobytes(), tuple(ledger._free))
        return lens, cells, tuple(self.rt._free_ids)

    def cells_of_live_seqs(self) -> int:
        for s, h in self.hist.items():  # llama.cpp holds exactly what we think it holds
            assert self.rt.seq_len(s) == len(h) == self.rt.pos_max(s) + 1, (s, len(h), self.rt.pos_max(s))
        assert set(self.hist) == set(self.rt._len)
        ledger = self.rt.ledger
        if ledger is None:
            return 0
        live = [ledger.cells[s] for s in self.hist if len(ledger.cells[s])]
        return len(np.unique(np.concatenate(live))) if live else 0


_FILES: dict[str, object] = {}
_STATS: dict[str, list[dict]] = {}
_REFS: dict[str, LlamaCppRuntime] = {}


def _file(kind: str, tmp):
    if kind not in _FILES:
        if kind == "llama":
            _FILES[kind] = TinyModel(tied=False, seed=4).write_gguf(tmp / "llama.gguf")
        elif kind == "jamba":
            _FILES[kind] = write_tiny_jamba(tmp / "jamba", seed=3)[0]
        else:
            _FILES[kind] = write_tiny_mamba(tmp / "mamba", seed=1)[0]
    return _FILES[kind]


@pytest.fixture(scope="module", autouse=True)
def _tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lcprops")
    _file("llama", d)
    _file("mamba", d)
    _file("jamba", d)
    yield
    for rt in _REFS.values():
        rt.close()
    for name, runs in _STATS.items():  # pytest -s shows what the machines exercised
        total = {k: sum(r[k] for r in runs) for k in runs[0]}
        print(f"\n{name}: {len(runs)} runs, {total}")


class LlamaCppMachine(P.ExecutorMachine):
    KIND = "llama"
    LC: dict = {}

    def make_runtime(self):
        return Tracked(LlamaCppRuntime(_FILES[self.KIND], n_threads=1, kv_f32=True, **self.LC))

    def teardown(self):
        self.rt.rt.close()
        _STATS.setdefault(type(self).__name__, []).append(dict(self.stats, checkpoints=self.checkpoints()))

    def checkpoints(self) -> int:
        return sum(1 for e in self.ex.cache if e.tokens and len(e.tokens) < 200)

    def ref_row(self, history):
        ref = _REFS.get(self.KIND)
        if ref is None:
            ref = _REFS[self.KIND] = LlamaCppRuntime(_FILES[self.KIND], n_threads=1, kv_f32=True, max_batch=1,
                                                    n_ctx=512, max_seq_len=512)
        s = ref.seq_create()
        try:
            (row,) = ref.step([Feed(s, list(history), True)])
        finally:
            ref.seq_free(s)
        return row

    def check_row(self, row, history):
        np.testing.assert_allclose(row, self.ref_row(history), atol=ROW_ATOL)

    def check_greedy(self, token, history):
        ref = self.ref_row(history)
        assert ref[token] >= ref.max() - ROW_ATOL, (history, token, int(np.argmax(ref)))


class LlamaPlainMachine(LlamaCppMachine):
    LC = dict(n_ctx=1024, page=4, max_batch=8, max_seq_len=64)


class LlamaTightPoolMachine(LlamaCppMachine):
    # 256 cells (llama.cpp's least) for up to 8 lanes of 64: a full KV faults lanes
    LC = dict(n_ctx=256, page=4, max_batch=8, max_seq_len=200, prefill_step_tokens=64)
    LONG_PROMPTS = True  # now and then 128-140 tokens: two of them overflow the pool


class MambaMachine(LlamaCppMachine):
    KIND = "mamba"
    LC = dict(page=4, max_batch=8, max_seqs=8, max_seq_len=160)
    LONG_PROMPTS = True


class JambaMachine(LlamaCppMachine):
    """A hybrid: exact_only like Mamba, with attention cells counted in a 256-cell pool."""

    KIND = "jamba"
    LC = dict(n_ctx=256, page=4, max_batch=8, max_seqs=8, max_seq_len=160)
    LONG_PROMPTS = True


SETTINGS = settings(P.SETTINGS, max_examples=8, stateful_step_count=30)


def _case(machine):
    case = machine.TestCase
    case.settings = SETTINGS
    return case


TestLlamaPlain = _case(LlamaPlainMachine)
TestLlamaTightPool = _case(LlamaTightPoolMachine)
TestMamba = _case(MambaMachine)
TestJamba = _case(JambaMachine)
