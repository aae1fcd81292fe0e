"""The llamacpp runtime on tiny random GGUFs (a Llama, a Mamba, a Mamba2 and a hybrid
Jamba, written by the tests):
numerics against transformers, every primitive, a full KV, bad files. Fast: no real model."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from superfluid.models import ModelLoadError  # noqa: E402
from superfluid.runtimes.base import Capacity, Feed, OutOfBoundary, RuntimePrimitives, UnknownSeq, Unsupported  # noqa: E402
from superfluid.runtimes.llamacpp.runtime import LlamaCppRuntime  # noqa: E402
from superfluid_testing.tiny_mamba import write_tiny_jamba, write_tiny_mamba, write_tiny_mamba2  # noqa: E402
from superfluid_testing.tiny import TinyModel  # noqa: E402

PROMPT = [5, 77, 130, 9, 200, 41, 33, 260, 12, 99, 7, 150, 64, 3, 18, 222, 90, 45, 8, 11]  # 20 tokens
ATOL = 2e-3  # llama.cpp's kernels against transformers' fp32 (f32 K/V)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamacpp")
    llama = TinyModel(tied=False, seed=4).write_gguf(d / "llama.gguf")
    mamba, mamba_hf = write_tiny_mamba(d / "mamba", seed=1)
    mamba2, mamba2_hf = write_tiny_mamba2(d / "mamba2", seed=2)
    jamba, jamba_hf = write_tiny_jamba(d / "jamba", seed=3)
    return {"dir": d, "llama": llama, "mamba": mamba, "mamba_hf": mamba_hf, "mamba2": mamba2, "mamba2_hf": mamba2_hf,
            "jamba": jamba, "jamba_hf": jamba_hf}


def _runtime(path, **kw):
    kw.setdefault("n_threads", 1)
    kw.setdefault("kv_f32", True)
    kw.setdefault("max_batch", 4)
    kw.setdefault("n_ctx", 512)
    return LlamaCppRuntime(path, **kw)


@pytest.fixture(scope="module")
def llama(files):
    return _runtime(files["llama"])


@pytest.fixture(scope="module")
def mamba(files):
    return _runtime(files["mamba"])


@pytest.fixture(scope="module")
def mamba2(files):
    return _runtime(files["mamba2"])


@pytest.fixture(scope="module")
def jamba(files):
    return _runtime(files["jamba"])


@pytest.fixture(scope="module")
def runtimes(llama, mamba, mamba2, jamba):
    return {"llama": llama, "mamba": mamba, "mamba2": mamba2, "jamba": jamba}


@pytest.fixture(scope="module", params=["llama", "mamba", "mamba2", "jamba"])
def rt(request, runtimes):
    return runtimes[request.param]


@pytest.fixture(scope="module")
def hf_models(files):
    from transformers import AutoModelForCausalLM, JambaForCausalLM, Mamba2ForCausalLM, MambaForCausalLM

    d = files["dir"]
    return {
        "llama": AutoModelForCausalLM.from_pretrained(d, gguf_file="llama.gguf", dtype=torch.float32).eval(),
        "mamba": MambaForCausalLM.from_pretrained(files["mamba_hf"], dtype=torch.float32).eval(),
        "mamba2": Mamba2ForCausalLM.from_pretrained(files["mamba2_hf"], dtype=torch.float32).eval(),
        "jamba": JambaForCausalLM.from_pretrained(files["jamba_hf"], dtype=torch.float32).eval(),
    }


def prefill(rt, tokens):
    s = rt.seq_create()
    (row,) = rt.step([Feed(s, list(tokens), True)])
    return s, row


def greedy(rt, seq, row, n):
    out = []
    for _ in range(n):
        t = int(np.argmax(row))
        out.append(t)
        (row,) = rt.step([Feed(seq, [t], True)])
    return out, row


def fresh_row(rt, tokens):
    s, row = prefill(rt, tokens)
    rt.seq_free(s)
    return row


def test_is_runtime_primitives(llama, mamba, mamba2, jamba):
    assert isinstance(llama, RuntimePrimitives)
    d = llama.desc
    assert not d.exact_only and d.truncate_partial and d.copy_shares_cells and d.max_seqs == 16
    assert d.vocab_size == 269 and d.cell_bytes > 0 and llama.mem_counters().cells_total >= 512
    m = mamba.desc
    assert m.exact_only and not m.truncate_partial and not m.copy_shares_cells and m.takeover_preferred
    assert mamba.mem_counters().cells_total == 0  # a recurrent state is not counted in cells
    assert mamba2.desc.exact_only and "mamba2" in mamba2.desc.runtime_id
    # a hybrid: exact_only (its Mamba layers cannot be cut back), its attention layers' cells counted
    j = jamba.desc
    assert j.exact_only and not j.truncate_partial and jamba.mem_counters().cells_total >= 512


# ------------------------------------------------------------------ numerics


@pytest.mark.parametrize("name", ["llama", "mamba", "mamba2", "jamba"])
def test_greedy_equals_transformers(name, runtimes, hf_models):
    rt, hf = runtimes[name], hf_models[name]
    with torch.inference_mode():
        ref = hf(torch.tensor([PROMPT])).logits[0].numpy()
        want = hf.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False,
                           attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long))[0, len(PROMPT):].tolist()
    s = rt.seq_create()
    rows = np.stack(rt.step_rows([Feed(s, PROMPT, True)])[0])
    assert np.abs(rows - ref).max() < ATOL
    got, _ = greedy(rt, s, rows[-1], 12)
    rt.seq_free(s)
    assert got == want and len(set(got)) > 3  # not one token repeated


def test_one_decode_over_mixed_feeds(rt):
    """Prefill chunks and decodes of several sequences in one step: each row as alone."""
    a, b, c = PROMPT, PROMPT[::-1][:13], [9, 8, 7]
    sa, sb, sc = rt.seq_create(), rt.seq_create(), rt.seq_create()
    rt.step([Feed(sa, a[:15], False), Feed(sb, b[:4], False)])
    rows = rt.step_rows([Feed(sa, a[15:], True), Feed(sb, b[4:], True), Feed(sc, c, True)])
    assert [len(r) for r in rows] == [5, 9, 3]
    for got, toks in ((rows[0][-1], a), (rows[1][-1], b), (rows[2][-1], c)):
        np.testing.assert_allclose(got, fresh_row(rt, toks), atol=1e-4)
    only = rt.step([Feed(sa, [1], False), Feed(sb, [2], True)])
    assert len(only) == 1  # rows only where asked
    for s in (sa, sb, sc):
        assert rt.seq_len(s) == rt.pos_max(s) + 1
        rt.seq_free(s)


def test_step_rejects_bad_feeds(rt):
    s = rt.seq_create()
    with pytest.raises(OutOfBoundary):
        rt.step([Feed(s, [rt.desc.vocab_size], True)])
    with pytest.raises(OutOfBoundary):
        rt.step([Feed(s, [1], True), Feed(s, [2], True)])
    with pytest.raises(UnknownSeq):
        rt.step([Feed(999, [1], True)])
    assert rt.seq_len(s) == 0 and rt.pos_max(s) == -1
    rt.seq_free(s)


# ------------------------------------------------------------------ sequences


def test_seeded_continuation_equals_fresh_prefill(rt):
    """A copy of a prefix (a checkpoint on Mamba: the whole state), continued, gives the
    rows and greedy tokens of a prefill of the whole history afresh."""
    src, _ = prefill(rt, PROMPT[:14])
    dst = rt.seq_create()
    rt.seq_copy(src, dst, 14)
    assert rt.seq_len(dst) == 14 == rt.pos_max(dst) + 1
    (row,) = rt.step([Feed(dst, PROMPT[14:], True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT), atol=1e-4)
    got, _ = greedy(rt, dst, row, 6)
    ref_seq, ref_row = prefill(rt, PROMPT)
    want, _ = greedy(rt, ref_seq, ref_row, 6)
    assert got == want
    # the source is untouched by its copy's growth
    (again,) = rt.step([Feed(src, PROMPT[14:], True)])
    np.testing.assert_allclose(again, row, atol=1e-4)
    for s in (src, dst, ref_seq):
        rt.seq_free(s)


def test_kv_copy_shares_cells_and_truncate_cuts(llama):
    rt = llama
    before = rt.mem_counters().cells_used
    src, _ = prefill(rt, PROMPT)
    assert rt.mem_counters().cells_used == before + 20
    dst = rt.seq_create()
    rt.seq_copy(src, dst, 12)
    assert rt.mem_counters().cells_used == before + 20  # shared, not copied
    assert rt.cells_released([dst]) == 0 and rt.cells_released([src]) == 8 and rt.cells_released([src, dst]) == 20
    (row,) = rt.step([Feed(dst, PROMPT[12:16], True)])
    assert rt.mem_counters().cells_used == before + 24
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT[:16]), atol=1e-4)
    rt.seq_truncate(src, 7)  # a partial cut: keeps 7 shared cells, frees 13 - 5 still held by dst
    assert rt.seq_len(src) == 7 == rt.pos_max(src) + 1
    assert rt.mem_counters().cells_used == before + 16
    (row,) = rt.step([Feed(src, PROMPT[7:], True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT), atol=1e-4)
    rt.seq_free(src)
    rt.seq_free(dst)
    assert rt.mem_counters().cells_used == before


@pytest.mark.parametrize("name", ["mamba", "mamba2", "jamba"])
def test_recurrent_state_refuses_a_partial_cut(name, runtimes):
    rt = runtimes[name]
    s, _ = prefill(rt, PROMPT)
    with pytest.raises(Unsupported):
        rt.seq_truncate(s, 10)  # llama.cpp's seq_rm refuses: the state of token 10 is gone
    assert rt.seq_len(s) == 20 == rt.pos_max(s) + 1
    dst = rt.seq_create()
    with pytest.raises(Unsupported):
        rt.seq_copy(s, dst, 10)
    rt.seq_truncate(s, 0)  # all of it: fine
    assert rt.seq_len(s) == 0 and rt.pos_max(s) == -1
    (row,) = rt.step([Feed(s, PROMPT, True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT), atol=1e-4)
    rt.seq_free(s)
    rt.seq_free(dst)


def test_hybrid_counts_its_attention_cells(files):
    """Jamba: one cell per token for its attention layer; a whole copy shares them; a full
    pool is Capacity as on a Llama (the Mamba layer's state is per sequence)."""
    rt = _runtime(files["jamba"], n_ctx=256)
    a, _ = prefill(rt, PROMPT * 5)
    b = rt.seq_create()
    rt.seq_copy(a, b, 100)
    assert rt.mem_counters().cells_used == 100 and rt.cells_released([a]) == 0 and rt.cells_released([a, b]) == 100
    c = rt.seq_create()
    with pytest.raises(Capacity):
        rt.step([Feed(c, (PROMPT * 8)[:157], True)])
    assert rt.seq_len(c) == 0 and rt.pos_max(c) == -1
    (row,) = rt.step([Feed(b, [1], True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT * 5 + [1]), atol=1e-4)
    assert rt.mem_counters().cells_used == 101
    rt.close()


def test_take_over_then_continue(rt):
    """A take-over keeps the entry's own sequence (no copy): on KV cut back to the seed,
    on Mamba whole; the continuation equals a fresh prefill."""
    entry, _ = prefill(rt, PROMPT[:16])
    keep = 16 if rt.desc.exact_only else 11
    rt.seq_truncate(entry, keep)
    (row,) = rt.step([Feed(entry, PROMPT[keep:], True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT), atol=1e-4)
    rt.seq_free(entry)


def test_export_import_round_trip(rt):
    s, _ = prefill(rt, PROMPT[:15])
    payload = rt.seq_export(s)
    used = rt.mem_counters().cells_used
    rt.seq_free(s)
    t = rt.seq_create()
    assert rt.seq_import(t, payload) == 15
    assert rt.seq_len(t) == 15 == rt.pos_max(t) + 1 and rt.mem_counters().cells_used == used
    (row,) = rt.step([Feed(t, PROMPT[15:], True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT), atol=1e-4)
    with pytest.raises(Unsupported):
        rt.seq_import(t, payload)  # not into a non-empty sequence
    u = rt.seq_create()
    with pytest.raises(Unsupported):
        rt.seq_import(u, dict(payload, runtime_id="other"))
    rt.seq_free(t)
    rt.seq_free(u)


def test_sequence_ids_run_out_as_capacity(files):
    rt = _runtime(files["llama"], max_batch=2, max_seqs=3)
    seqs = [rt.seq_create() for _ in range(3)]
    with pytest.raises(Capacity):
        rt.seq_create()
    rt.seq_free(seqs[0])
    assert rt.seq_create() == seqs[0]


def test_full_kv_is_capacity_and_changes_nothing(files):
    """llama_decode's 'no KV slot' (rc 1) is Capacity, the memory as it was; the ledger's
    count is llama.cpp's: exactly the free cells fit (shared cells are not counted twice)."""
    rt = _runtime(files["llama"], n_ctx=256)
    total = rt.mem_counters().cells_total
    assert total == 256
    a, _ = prefill(rt, PROMPT * 5)  # 100 cells
    b = rt.seq_create()
    rt.seq_copy(a, b, 100)  # shares them
    free = total - rt.mem_counters().cells_used
    assert free == 156
    big = (PROMPT * 8)[: free + 1]
    c = rt.seq_create()
    with pytest.raises(Capacity):
        rt.step([Feed(c, big, True)])
    assert rt.seq_len(c) == 0 and rt.pos_max(c) == -1 and rt.mem_counters().cells_used == 100
    rt.step([Feed(c, big[:-1], False)])  # exactly what is free fits
    assert rt.mem_counters().cells_used == total
    with pytest.raises(Capacity):
        rt.step([Feed(a, [1], True)])
    assert rt.seq_len(a) == 100 == rt.pos_max(a) + 1
    rt.seq_free(c)
    (row,) = rt.step([Feed(a, [1], True)])
    np.testing.assert_allclose(row, fresh_row(rt, PROMPT * 5 + [1]), atol=1e-4)


# ------------------------------------------------------------------ bad files


def test_unknown_architecture_names_the_file(files, tmp_path):
    path, _ = write_tiny_mamba(tmp_path / "m", arch="mamba9")
    with pytest.raises(ModelLoadError, match=r"mamba\.gguf.*(unknown model architecture|mamba9)"):
        LlamaCppRuntime(path, n_threads=1)


def test_truncated_file_names_the_file(files, tmp_path):
    data = files["llama"].read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ModelLoadError, match="cut.gguf"):
        LlamaCppRuntime(bad, n_threads=1)


def test_vocabulary_mismatch_names_the_file(tmp_path):
    path = TinyModel(shapes={"token_embd.weight": (200, 64)}, tied=False).write_gguf(tmp_path / "vocab.gguf")
    with pytest.raises(ModelLoadError, match=r"vocab\.gguf.*token_embd"):
        LlamaCppRuntime(path, n_threads=1)


def test_a_quantized_llama_loads_and_runs(tmp_path):
    rt = _runtime(TinyModel(qtype=Q.Q8_0, arch="qwen2", seed=3).write_gguf(tmp_path / "q8.gguf"), kv_f32=False)
    s, row = prefill(rt, PROMPT)
    assert row.shape == (rt.desc.vocab_size,) and np.isfinite(row).all()
    assert "qwen2" in rt.desc.runtime_id


# ------------------------------------------------------------------ tokenizers

TEXTS = ["Hello world, the cat sat on the mat.", " café naïve  über 12 don't", "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_llamacpp_tokenizer_agrees_with_ours(tmp_path, kind):
    """llama.cpp's own tokenizer (for vocabularies ours does not know) gives our ids, text,
    token bytes, specials and end tokens on the vocabularies both know."""
    from superfluid.runtimes.llamacpp.tokenizer import LlamaCppTokenizer
    from superfluid.tokenizer import Tokenizer

    path = TinyModel(tokenizer=kind).write_gguf(tmp_path / f"{kind}.gguf")
    ours, lc = Tokenizer.from_gguf(path), LlamaCppTokenizer(path)
    assert lc.vocab_size == ours.vocab_size and lc.bos_id == ours.bos_id and lc.add_bos == ours.add_bos
    assert set(ours.eos_ids) <= set(lc.eos_ids) and lc.special_ids == ours.special_ids
    for text in TEXTS:
        for special in (False, True):
            ids = ours.encode(text, add_special_tokens=special)
            assert lc.encode(text, add_special_tokens=special) == ids
            assert lc.decode(ids) == ours.decode(ids)
    assert all(lc.token_bytes(i) == ours.token_bytes(i) for i in range(ours.vocab_size))
    msgs = [{"role": "user", "content": "hi"}]
    assert lc.apply_chat_template(msgs) == ours.apply_chat_template(msgs)


def test_a_pretokenizer_only_llamacpp_knows(tmp_path):
    """A BPE vocabulary with a pre-tokenizer ours lacks (gpt-4o) is tokenized by llama.cpp,
    through the same engine; one llama.cpp does not know either is a load error."""
    from superfluid import LLM, SamplingParams
    from superfluid.runtimes.llamacpp.tokenizer import LlamaCppTokenizer

    path = TinyModel(tokenizer_pre="gpt-4o", tied=False, seed=4).write_gguf(tmp_path / "gpt4o.gguf")
    llm = LLM(str(path), runtime="llamacpp", runtime_args=dict(n_threads=1, n_ctx=512, max_batch=2))
    assert isinstance(llm.tokenizer, LlamaCppTokenizer)
    out = llm.chat([{"role": "user", "content": "the cat sat"}], SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    bad = TinyModel(tokenizer_pre="nosuchpre").write_gguf(tmp_path / "nopre.gguf")
    with pytest.raises(ModelLoadError, match=r"nopre\.gguf.*pre-tokenizer"):
        LlamaCppRuntime(bad, n_threads=1)


# ------------------------------------------------------------------ the engine on a recurrent model


@pytest.mark.parametrize("name", ["mamba", "jamba"])
def test_recurrent_resend_next_turn_and_forks_start_from_exact_checkpoints(files, name):
    """LLM over an exact_only runtime: a resent prompt and the next turn start from the
    checkpoint one token short of the earlier prompt's end, with unchanged text; the n > 1
    siblings of a prompt wait for the first one's checkpoint and fork from it."""
    from superfluid import LLM, SamplingParams
    from superfluid.engine.config import SchedulerConfig

    llm = LLM(str(files[name]), runtime="llamacpp", runtime_args=dict(n_threads=1, kv_f32=True, max_batch=4))
    greedy_p = SamplingParams(temperature=0, max_tokens=8)
    msgs = [{"role": "user", "content": "the theory of everything is an interesting one, " * 4}]
    first = llm.chat(msgs, greedy_p)[0]
    n = len(first.prompt_token_ids)
    assert n > 128 and first.num_cached_tokens == 0
    again = llm.chat(msgs, greedy_p)[0]
    assert again.num_cached_tokens == n - 1 and again.outputs[0].token_ids == first.outputs[0].token_ids
    turn2 = [{"role": "user", "content": "tell me about the theory of everything, please " * 4}]
    nxt_prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(turn2))
    a = llm.generate(nxt_prompt, greedy_p)[0]
    b = llm.generate(nxt_prompt + a.outputs[0].token_ids + [5, 6, 7], greedy_p)[0]  # the next turn
    assert b.num_cached_tokens >= len(nxt_prompt) - 1
    fresh = LLM(str(files[name]), runtime="llamacpp", runtime_args=dict(n_threads=1, kv_f32=True, max_batch=4),
                scheduler=SchedulerConfig(prefix_caching=False))
    ref = fresh.generate(nxt_prompt + a.outputs[0].token_ids + [5, 6, 7], greedy_p)[0]
    assert ref.num_cached_tokens == 0 and ref.outputs[0].token_ids == b.outputs[0].token_ids
    short = [{"role": "user", "content": "forks"}]  # short: checkpointed because its forks wait for it
    forks = llm.chat(short, SamplingParams(temperature=1.0, n=3, max_tokens=6))[0]
    assert forks.num_cached_tokens == len(forks.prompt_token_ids) - 1
    assert len({tuple(c.token_ids) for c in forks.outputs}) == 3


def test_speculative_drafts_verified_with_step_rows_change_no_text(files):
    from superfluid import LLM, SamplingParams
    from superfluid.engine.config import SchedulerConfig

    prompts = [PROMPT[:10] * 6, PROMPT[3:10] * 8]  # repetitive: prompt lookup finds drafts
    got = {}
    for spec in (False, True):
        llm = LLM(str(files["llama"]), runtime="llamacpp", runtime_args=dict(n_threads=1, kv_f32=True),
                  scheduler=SchedulerConfig(speculative=spec))
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        got[spec] = [o.outputs[0].token_ids for o in outs]
        if spec:
            assert llm.engine.scheduler.stats.spec_proposed > 0
    assert got[True] == got[False]


def test_kv_cache_mb_sizes_the_pool(files):
    rt = _runtime(files["llama"], kv_cache_mb=1)
    total, cell = rt.mem_counters().cells_total, rt.desc.cell_bytes
    assert 2**20 // cell <= total < 2**20 // cell + 256  # llama.cpp pads the context to 256 cells
    rt.close()
