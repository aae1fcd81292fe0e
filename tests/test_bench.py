"""The benchmark tooling against a fake streaming OpenAI server (no model)."""

from __future__ import annotations

import asyncio
import json
import math

import numpy as np
import pytest

from superfluid.bench import cli
from superfluid.bench.datasets import DATASETS, TOKENS_PER_WORD, make_dataset, shared_system_prompt
from superfluid_testing.fake_server import FakeServer
from superfluid.bench.serve import (
    RESULT_KEYS,
    STAT_KEYS,
    BenchConfig,
    RequestRecord,
    poisson_arrivals,
    run_benchmark_async,
    stats_ms,
    summarize,
)


def bench(requests, server_kw=None, **config_kw):
    """Run the load generator against a fresh fake server; (result, server)."""

    async def go():
        srv = await FakeServer(**(server_kw or {})).start()
        try:
            cfg = BenchConfig(base_url=srv.url, progress=False, **config_kw)
            return await run_benchmark_async(cfg, requests), srv
        finally:
            await srv.stop()

    return asyncio.run(go())


# ------------------------------------------------------------------ load generator


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("send_usage", [True, False])
def test_counts_output_tokens_from_usage_or_chunks(endpoint, send_usage):
    reqs = make_dataset("chat", 10, seed=1, output_len=24)
    r, srv = bench(reqs, {"send_usage": send_usage, "cached_tokens": 5}, endpoint=endpoint, max_concurrency=4)
    assert r["completed"] == 10 and r["failed"] == 0 and r["errors"] == []
    assert r["total_output_tokens"] == sum(q.max_tokens for q in reqs)  # the fake streams max_tokens chunks
    assert r["output_tokens_source"] == ({"usage": 10, "chunks": 0} if send_usage else {"usage": 0, "chunks": 10})
    assert r["cached_prompt_tokens"] == (50 if send_usage else None)
    assert r["model"] == "fake-model"  # from /v1/models
    body = srv.bodies[0]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert ("messages" in body) == (endpoint == "chat") and ("prompt" in body) == (endpoint == "completions")


def test_concurrency_is_respected():
    reqs = make_dataset("chat", 12, seed=2, output_len=8)
    r, srv = bench(reqs, {"first_delay_s": 0.03, "token_delay_s": 0.002}, max_concurrency=3)
    assert srv.max_in_flight == 3
    assert r["max_in_flight"] == 3 and r["completed"] == 12


def test_unbounded_concurrency_sends_everything_at_once():
    reqs = make_dataset("chat", 10, seed=2, output_len=4)
    r, srv = bench(reqs, {"first_delay_s": 0.1}, max_concurrency=None)
    assert srv.max_in_flight == 10


def test_latencies_are_measured():
    reqs = make_dataset("grounded", 4, seed=0, output_len=10)
    r, _ = bench(reqs, {"first_delay_s": 0.05, "token_delay_s": 0.01}, max_concurrency=1)
    assert 45 <= r["ttft_ms"]["p50"] < 500
    assert 8 <= r["itl_ms"]["p50"] < 200
    assert r["e2e_ms"]["p50"] >= r["ttft_ms"]["p50"] + 9 * 8
    assert r["output_tokens_per_s"] == pytest.approx(r["total_output_tokens"] / r["duration_s"])
    assert r["requests_per_s"] == pytest.approx(4 / r["duration_s"])


def test_ignore_eos_is_an_option_and_never_sent_with_json():
    r, srv = bench(make_dataset("chat", 3, output_len=4), max_concurrency=1)
    assert all("ignore_eos" not in b for b in srv.bodies)
    r, srv = bench(make_dataset("chat", 3, output_len=4), max_concurrency=1, ignore_eos=True,
                   extra_body={"n_predict": 4})
    assert all(b["ignore_eos"] is True and b["n_predict"] == 4 for b in srv.bodies)
    r, srv = bench(make_dataset("json", 3, output_len=4), max_concurrency=1, ignore_eos=True)
    assert all("ignore_eos" not in b and b["response_format"]["type"] == "json_schema" for b in srv.bodies)


def test_http_errors_are_counted_not_raised():
    async def go():
        srv = await FakeServer().start()
        try:
            cfg = BenchConfig(base_url=srv.url, model="m", progress=False, endpoint="chat")
            cfg_bad = BenchConfig(base_url=srv.url + "/nope", model="m", progress=False)
            return await run_benchmark_async(cfg_bad, make_dataset("chat", 3, output_len=4)), cfg
        finally:
            await srv.stop()

    r, _ = asyncio.run(go())
    assert r["completed"] == 0 and r["failed"] == 3 and "HTTP 404" in r["errors"][0]
    assert r["ttft_ms"]["p50"] is None


# ------------------------------------------------------------------ statistics


def test_percentiles_match_numpy():
    rng = np.random.default_rng(0)
    lat = rng.lognormal(-3, 1, size=257).tolist()
    s = stats_ms(lat)
    a = np.array(lat) * 1000
    assert s["mean"] == pytest.approx(a.mean())
    for q in (50, 90, 99):
        assert s[f"p{q}"] == pytest.approx(np.percentile(a, q))
    assert stats_ms([0.1, 0.2, 0.3, 0.4]) == pytest.approx({"mean": 250.0, "p50": 250.0, "p90": 370.0, "p99": 397.0})
    assert stats_ms([]) == {k: None for k in STAT_KEYS}


def test_summary_of_known_records():
    recs = []
    for i in range(1, 11):  # ttft i*10 ms, chunks every i ms, 5 tokens
        ttft = i / 100
        times = [ttft + k * i / 1000 for k in range(5)]
        recs.append(RequestRecord(ok=True, ttft_s=ttft, e2e_s=times[-1], chunk_times=times, output_tokens=5,
                                  tokens_from_usage=True, prompt_tokens=100, cached_tokens=40))
    recs.append(RequestRecord(ok=False, error="boom"))
    r = summarize(BenchConfig("http://x", progress=False), "m", recs, duration=2.0, max_in_flight=4)
    ttft = np.arange(1, 11) * 10.0
    assert r["ttft_ms"]["p90"] == pytest.approx(np.percentile(ttft, 90))
    itl = np.repeat(np.arange(1, 11), 4).astype(float)
    assert r["itl_ms"]["p50"] == pytest.approx(np.percentile(itl, 50))
    assert r["tpot_ms"]["p99"] == pytest.approx(np.percentile(np.arange(1, 11), 99))
    assert r["e2e_ms"]["p50"] == pytest.approx(np.percentile(ttft + 4 * np.arange(1, 11), 50))
    assert (r["completed"], r["failed"], r["errors"]) == (10, 1, ["boom"])
    assert r["output_tokens_per_s"] == 25.0 and r["requests_per_s"] == 5.0
    assert r["cached_prompt_tokens"] == 400 and r["cached_ratio"] == 0.4


# ------------------------------------------------------------------ Poisson arrivals


def test_poisson_schedule_has_the_right_rate():
    t = poisson_arrivals(4000, rate=25.0, seed=3)
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 25.0, rel=0.06)
    assert gaps.std() == pytest.approx(1 / 25.0, rel=0.1)  # exponential: std == mean
    assert np.all(poisson_arrivals(5, math.inf) == 0)
    assert np.array_equal(poisson_arrivals(50, 3.0, seed=1), poisson_arrivals(50, 3.0, seed=1))


def test_poisson_arrivals_reach_the_server_at_the_right_rate():
    reqs = make_dataset("chat", 60, seed=4, output_len=2)
    r, srv = bench(reqs, max_concurrency=None, request_rate=60.0, seed=5)
    span = srv.arrivals[-1] - srv.arrivals[0]
    rate = (len(srv.arrivals) - 1) / span
    assert 30.0 < rate < 120.0  # loose: 59 exponential gaps
    assert r["request_rate"] == 60.0


# ------------------------------------------------------------------ datasets


@pytest.mark.parametrize("name", DATASETS)
def test_datasets_are_reproducible(name):
    a, b = make_dataset(name, 12, seed=7), make_dataset(name, 12, seed=7)
    assert a == b
    assert make_dataset(name, 12, seed=8) != a
    assert len(a) == 12 and all(r.max_tokens >= 1 for r in a)


def test_chat_lengths_vary():
    reqs = make_dataset("chat", 64, seed=0, output_len=128)
    lens = [len(r.messages[-1]["content"].split()) for r in reqs]
    outs = [r.max_tokens for r in reqs]
    assert min(lens) < 20 and max(lens) > 200
    assert min(outs) >= 32 and max(outs) <= 128 and len(set(outs)) > 10


def test_shared_prefix_is_shared_and_long():
    reqs = make_dataset("shared-prefix", 16, seed=0)
    systems = {r.messages[0]["content"] for r in reqs}
    assert systems == {shared_system_prompt(0)}
    assert len(shared_system_prompt(0).split()) * TOKENS_PER_WORD > 900  # ~1,000 tokens
    assert len({r.messages[1]["content"] for r in reqs}) > 1  # the questions differ


def test_nocache_variant_differs_at_the_start():
    reqs = make_dataset("shared-prefix-nocache", 16, seed=0)
    systems = [r.messages[0]["content"] for r in reqs]
    assert len(set(systems)) == 16
    assert len({s[:30] for s in systems}) == 16  # the nonce comes first: no shared prefix past the header
    assert all(s.endswith(shared_system_prompt(0)) for s in systems)  # same length, same handbook


def test_multi_turn_resends_the_whole_history():
    reqs = make_dataset("multi-turn", 10, seed=0, output_len=32)
    assert {r.kind for r in reqs} == {"multi-turn"}
    for prev, cur in zip(reqs, reqs[1:]):
        if cur.meta["session"] == prev.meta["session"]:
            assert cur.meta["turn"] == prev.meta["turn"] + 1
            assert cur.messages[:len(prev.messages)] == prev.messages  # the history, resent unchanged
            assert [m["role"] for m in cur.messages[len(prev.messages):]] == ["assistant", "user"]
        else:
            assert cur.meta["turn"] == 0 and len(cur.messages) == 1
    assert max(r.meta["turn"] for r in reqs) == 3


def test_multi_turn_sessions_send_turns_in_order_with_the_real_answers():
    reqs = make_dataset("multi-turn", 8, seed=0, output_len=6)  # two sessions of four turns
    r, srv = bench(reqs, {"first_delay_s": 0.02, "token_delay_s": 0.002}, max_concurrency=8)
    assert r["completed"] == 8 and r["failed"] == 0
    assert srv.max_in_flight <= 2  # one turn of each session at a time (8 if turns went together)
    by_prompt = {json.dumps(b["messages"][-1]): (b, t) for b, t in zip(srv.bodies, srv.arrivals)}
    for q in reqs:
        body, _ = by_prompt[json.dumps(q.messages[-1])]
        sent = body["messages"]
        assert [m["role"] for m in sent] == [m["role"] for m in q.messages]
        assert [m["content"] for m in sent if m["role"] == "user"] == [m["content"] for m in q.messages if m["role"] == "user"]
        # the fake streams "tok " max_tokens times: every earlier answer is what it sent
        assert all(m["content"] == "tok " * 6 for m in sent if m["role"] == "assistant")
    # turn k+1 of a session arrives after turn k's stream ended (at least 6 token delays)
    for a, b in zip(reqs, reqs[1:]):
        if a.meta["session"] == b.meta["session"]:
            ta, tb = by_prompt[json.dumps(a.messages[-1])][1], by_prompt[json.dumps(b.messages[-1])][1]
            assert tb - ta >= 0.02 + 5 * 0.002


def test_grounded_sources_are_in_the_prompt():
    reqs = make_dataset("grounded", 10, seed=0, output_len=64)
    assert {r.kind for r in reqs} == {"grounded-text", "grounded-code"}
    for r in reqs:
        assert r.source and r.source in r.messages[-1]["content"]
        assert len(r.source.split()) * TOKENS_PER_WORD >= 0.5 * r.max_tokens  # enough to copy from


def test_json_requests_ask_for_a_schema_grounded_in_the_text():
    for r in make_dataset("json", 8, seed=0):
        assert r.response_format["type"] == "json_schema"
        assert r.response_format["json_schema"]["schema"]["required"] == ["name", "age", "city", "skills"]
        exp = r.meta["expected"]
        assert exp["name"] in r.source and exp["city"] in r.source and r.source in r.messages[-1]["content"]
        assert not r.ignore_eos_ok


# ------------------------------------------------------------------ results JSON / CLI


def test_cli_serve_writes_the_documented_keys(tmp_path, capsys):
    out = tmp_path / "r.json"

    async def go():
        srv = await FakeServer(token_delay_s=0.001).start()
        try:
            args = ["serve", "--base-url", srv.url + "/v1", "-n", "6", "-c", "2", "--dataset", "shared-prefix",
                    "--output-len", "5", "--out", str(out), "--no-progress", "--label", "t"]
            return await asyncio.to_thread(cli.main, args)
        finally:
            await srv.stop()

    assert asyncio.run(go()) == 0
    r = json.loads(out.read_text())
    assert set(RESULT_KEYS) <= set(r)
    for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert set(r[k]) == set(STAT_KEYS) and r[k]["p50"] is not None
    assert r["dataset"] == "shared-prefix" and r["num_requests"] == 6 and r["total_output_tokens"] == 30
    assert "output" in capsys.readouterr().out


def test_cli_dataset_prints_jsonl(capsys):
    assert cli.main(["dataset", "grounded", "-n", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and all(json.loads(x)["messages"] for x in lines)


def test_add_parsers_adds_bench():
    import argparse

    ap = argparse.ArgumentParser()
    cli.add_parsers(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["bench", "serve", "--concurrency", "3", "--request-rate", "2.5"])
    assert args.func is cli.cmd_serve and args.concurrency == 3 and args.request_rate == 2.5
