"""prompt_cache_key on the toy runtime, through the Python API: keyed entries are routed
by key and protected within the quota; 24h entries outlive others in host memory;
prompt logprobs come from the prefill's rows."""

from __future__ import annotations

import random

import pytest

from superfluid import LLM, SamplingParams
from superfluid.engine.config import EngineConfig, SchedulerConfig
from superfluid.engine.engine import Engine
from superfluid.engine.params import ParamError
from superfluid.executor import Executor, ExecutorConfig
from superfluid.executor.cache import PrefixCache, Retention
from superfluid.rings import Rings
from superfluid.runtimes.toy import ToyRuntime

PROMPT = 60  # tokens: with 4 generated, an entry of 64 (16 pages of 4)


def make_llm(protected: float = 0.25, entries_in_host: int = 2) -> LLM:
    rt = ToyRuntime(n_cells=400)
    rings = Rings(rt.desc.vocab_size)
    host = entries_in_host * 64 * rt.desc.cell_bytes
    ex = Executor(rt, rings, ExecutorConfig(host_cache_bytes=host))
    config = EngineConfig(runtime="toy", scheduler=SchedulerConfig(cache_protected_fraction=protected))
    return LLM(engine=Engine(ex, rings, rt.tokenizer, config))


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 150) for _ in range(PROMPT)]


def run(llm: LLM, ids: list[int], **kw):
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **kw))[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


def flood(llm: LLM, rng: random.Random, n: int = 16) -> None:
    for _ in range(n):  # 16 x 64 cells: well past the pool (400) and host memory (2 entries)
        run(llm, prompt(rng))


def test_a_keyed_prefix_survives_a_flood_that_evicts_an_unkeyed_one():
    llm, rng = make_llm(), random.Random(1)
    keyed, unkeyed = prompt(rng), prompt(rng)
    run(llm, keyed, prompt_cache_key="tenant")
    run(llm, unkeyed)
    flood(llm, rng)
    assert run(llm, unkeyed)[0] == 0
    assert run(llm, keyed, prompt_cache_key="tenant")[0] >= PROMPT - 4
    stats = llm.engine.scheduler.stats
    assert stats.cache_hits["in_memory"] == 1 and stats.cache_bytes["in_memory"][1] > 0


def test_a_burst_admitted_at_once_does_not_evict_a_keyed_prefix():
    llm, rng = make_llm(), random.Random(3)
    keyed = prompt(rng)
    run(llm, keyed, prompt_cache_key="tenant")
    burst = [prompt(rng) for _ in range(12)]  # one generate call: admitted together, as the pool allows
    llm.generate(burst, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert run(llm, keyed, prompt_cache_key="tenant")[0] >= PROMPT - 4


def test_without_a_key_the_same_flood_evicts_it():
    llm, rng = make_llm(), random.Random(1)
    first = prompt(rng)
    run(llm, first)
    flood(llm, rng)
    assert run(llm, first)[0] == 0


def test_a_24h_entry_comes_back_from_host_memory():
    llm, rng = make_llm(), random.Random(2)
    long_lived = prompt(rng)
    cached, tokens = run(llm, long_lived, prompt_cache_key="z", prompt_cache_retention="24h")
    assert cached == 0
    run(llm, prompt(rng), prompt_cache_key="newer")  # takes the quota (one entry)
    flood(llm, rng)
    ex = llm.engine.ex
    (entry,) = [e for e in ex.cache if e.retention == Retention.EXTENDED]
    assert entry.seq is None and entry.exported is not None  # out of the pool, in host memory
    assert llm.engine.scheduler.stats.cache_bytes["24h"][2] == entry.bytes
    back, again = run(llm, long_lived, prompt_cache_key="z", prompt_cache_retention="24h")
    assert back >= PROMPT - 4 and again == tokens


def test_an_in_memory_entry_past_the_quota_is_gone_after_the_same_flood():
    llm, rng = make_llm(), random.Random(2)
    long_lived = prompt(rng)
    run(llm, long_lived, prompt_cache_key="z", prompt_cache_retention="in_memory")
    run(llm, prompt(rng), prompt_cache_key="newer")
    flood(llm, rng)
    assert run(llm, long_lived, prompt_cache_key="z")[0] == 0


def test_a_key_routes_to_its_own_entries_first():
    cache = PrefixCache()
    shared = list(range(40))
    cache.insert(1, shared + [1] * 8, 48, 48, now=5)  # unkeyed, longer common prefix
    cache.insert(2, shared[:32] + [2] * 8, 40, 40, now=1, key=7, retention=Retention.IN_MEMORY)
    prompt_ = shared + [9] * 8
    assert cache.longest_prefix(prompt_, 4, False)[0].seq == 1
    assert cache.longest_prefix(prompt_, 4, False, key=7)[0].seq == 2
    assert cache.longest_prefix(prompt_, 4, False, key=8)[0].seq == 1  # an unknown key: any entry
    # protection: the most recent keyed entries within the quota; past it, least recently used first
    cache.insert(3, [5] * 8, 8, 8, now=9, key=7, retention=Retention.IN_MEMORY)
    assert cache.protected(8) == frozenset({3}) and cache.protected(48) == frozenset({2, 3})
    assert [e.seq for e in cache.eviction_order(cache.protected(8))] == [2, 1]
    assert [e.seq for e in cache.eviction_order(cache.protected(48))] == [1]


def test_bad_retention_is_a_param_error():
    with pytest.raises(ParamError) as e:
        SamplingParams(prompt_cache_key="k", prompt_cache_retention="forever").validate()
    assert e.value.param == "prompt_cache_retention"


def test_prompt_logprobs_score_each_prompt_token_from_the_prefill():
    llm = LLM(runtime="toy")
    ids = list(range(5, 25))
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0].outputs[0]
    pl = out.prompt_logprobs
    assert len(pl) == len(ids) and pl[0] is None
    for p in (1, 7, len(ids) - 1):
        ref = llm.generate([ids[:p]], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0].logprobs[0]
        top = {t: v.logprob for t, v in ref.items() if v.rank}
        assert {t: v.logprob for t, v in pl[p].items() if v.rank} == pytest.approx(top)
        assert ids[p] in pl[p]
    # scoring changes no token
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0]
    assert plain.token_ids == out.token_ids
