"""benchmarks/compare.py end to end against two fake servers (no model, no subprocess)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from pathlib import Path

import pytest

from superfluid_testing.fake_server import FakeServer

ROOT = Path(__file__).resolve().parent.parent


def load_compare():
    spec = importlib.util.spec_from_file_location("bench_compare", ROOT / "benchmarks" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def two_servers():
    """A 'fast' and a 'slow' fake server on a background event loop."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    fast = asyncio.run_coroutine_threadsafe(FakeServer(first_delay_s=0.002, cached_tokens=7).start(), loop).result()
    slow = asyncio.run_coroutine_threadsafe(FakeServer(first_delay_s=0.08, token_delay_s=0.004).start(), loop).result()
    yield fast, slow
    for s in (fast, slow):
        asyncio.run_coroutine_threadsafe(s.stop(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    t.join(5)


def run_compare(servers, tmp_path, tag: str, *args: str) -> dict:
    """compare.py over the two fake servers (superfluid: the fast one), toy-labelled; its report."""
    fast, slow = servers
    rc = load_compare().main(["--superfluid-url", fast.url, "--llama-url", slow.url, "--runtime", "toy",
                              "--tag", tag, "--out-dir", str(tmp_path), "--no-progress", *args])
    assert rc == 0
    return json.loads((tmp_path / f"compare_{tag}.json").read_text())


def test_compare_runs_ab_rounds_and_reports(two_servers, tmp_path):
    report = run_compare(two_servers, tmp_path, "t", "--concurrency", "1,4", "--datasets", "chat,grounded",
                         "--num-requests", "4", "--output-len", "6", "--repeats", "2", "--prefix-requests", "3",
                         "--prefix-output-len", "2")
    md = (tmp_path / "compare_t.md").read_text()
    # per round: superfluid alone (2 concurrencies x 2 datasets, then the 2 prefix datasets), then llama-server
    assert len(report["runs"]) == 2 * (4 + 2 + 4)
    order = [(r["server"], r["round"]) for r in report["runs"]]
    assert order == ([("superfluid", 0)] * 6 + [("llama-server", 0)] * 4 + [("superfluid", 1)] * 6
                     + [("llama-server", 1)] * 4)  # one server's whole turn, then the next
    seeds = {(r["server"], r["round"], r["concurrency"], r["dataset"]): r["result"]["seed"] for r in report["runs"]}
    assert seeds[("superfluid", 0, 1, "chat")] == seeds[("llama-server", 0, 1, "chat")] != seeds[("superfluid", 1, 1, "chat")]
    matrix_seeds = {(r["concurrency"], r["round"]): r["result"]["seed"] for r in report["runs"]
                    if not r["dataset"].startswith("prefix/")}
    assert len(set(matrix_seeds.values())) == 4  # a seed per (concurrency, round)
    assert [(m["server"], m["round"]) for m in report["memory"]] == [
        ("superfluid", 0), ("llama-server", 0), ("superfluid", 1), ("llama-server", 1)]
    assert report["meta"]["one_server_at_a_time"] is False  # servers given by URL are not started by us
    png = tmp_path / "compare_t.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    rows = report["comparison"]
    assert len(rows) == 4
    for row in rows:
        a, b = row["superfluid"], row["llama-server"]
        assert row["tokens_per_s_ratio"] == pytest.approx(a["output_tokens_per_s"] / b["output_tokens_per_s"])
        assert row["tokens_per_s_ratio"] > 1.0 and row["ttft_p50_ratio"] < 1.0  # fast beats slow
        assert a["rounds"] == 2 and a["failed"] == 0
    c1g = next(r for r in rows if r["concurrency"] == 1 and r["dataset"] == "grounded")
    assert c1g["target_tokens_per_s_ratio"] == 1.3
    assert report["prefix_cache"]["speedup"] is not None
    assert "Tooling check only" in md and "| 4 | chat |" in md


def test_interleave_per_workload_alternates_fresh_servers(two_servers, tmp_path):
    report = run_compare(two_servers, tmp_path, "w", "--concurrency", "1", "--datasets", "chat,grounded",
                         "--num-requests", "2", "--output-len", "4", "--repeats", "1", "--prefix-requests", "2",
                         "--prefix-output-len", "2", "--interleave", "workload")
    order = [(r["server"], r["dataset"]) for r in report["runs"]]
    assert order == [("superfluid", "chat"), ("llama-server", "chat"), ("superfluid", "grounded"),
                     ("superfluid", "prefix/shared-prefix"), ("superfluid", "prefix/shared-prefix-nocache"),
                     ("llama-server", "grounded")]  # a pair per workload; the prefix runs once, at the end
    assert len(report["memory"]) == 4  # a (re)start per server per workload
    steal = [r["result"]["cpu_steal_share"] for r in report["runs"]]
    assert all(x is None or 0.0 <= x <= 1.0 for x in steal)
    assert "CPU steal %" in (tmp_path / "compare_w.md").read_text()


def test_medians_and_targets():
    compare = load_compare()

    def res(tps, ttft):
        st = {"mean": ttft, "p50": ttft, "p90": ttft, "p99": ttft}
        return {"output_tokens_per_s": tps, "requests_per_s": 1.0, "ttft_ms": st, "itl_ms": st, "tpot_ms": st,
                "e2e_ms": st, "cached_ratio": None, "failed": 0, "total_input_tokens": 10, "total_output_tokens": 5,
                "completed": 1}

    runs = []
    for server, vals in (("superfluid", [(300, 5), (330, 6), (360, 4)]), ("llama-server", [(100, 5), (90, 5), (110, 5)])):
        for i, (tps, ttft) in enumerate(vals):
            runs.append({"server": server, "concurrency": 32, "dataset": "chat", "round": i, "result": res(tps, ttft)})
    med = compare.medians(runs)
    assert med["superfluid"]["32"]["chat"]["output_tokens_per_s"] == 330
    assert med["llama-server"]["32"]["chat"]["output_tokens_per_s"] == 100

    class A:
        concurrency = [32]
        datasets = ["chat"]

    (row,) = compare.comparisons(med, A)
    assert row["tokens_per_s_ratio"] == pytest.approx(3.3) and row["ttft_p50_ratio"] == 1.0

    class L:  # --runtime llamacpp: the same kernels; multi-turn c=8 must reach 2x, chat c=1 1.0x
        runtime = "llamacpp"
        concurrency = [8, 1]
        datasets = ["multi-turn", "chat"]

    lruns = [{"server": srv, "concurrency": c, "dataset": ds, "round": 0, "result": res(tps, 5)}
             for srv, c, ds, tps in (("superfluid", 8, "multi-turn", 190), ("llama-server", 8, "multi-turn", 100),
                                     ("superfluid", 1, "chat", 101), ("llama-server", 1, "chat", 100))]
    rows = {(r["dataset"], r["concurrency"]): r for r in compare.comparisons(compare.medians(lruns), L)}
    assert rows[("multi-turn", 8)]["target_tokens_per_s_ratio"] == 2.0 and rows[("multi-turn", 8)]["target_met"] is False
    assert rows[("chat", 1)]["target_tokens_per_s_ratio"] == 1.0 and rows[("chat", 1)]["target_met"] is True
    assert row["target_met"] is False  # >= 3x, but the TTFT p50 target at c=32 is 0.5x
    med["llama-server"]["32"]["chat"]["ttft_ms.p50"] = 12.0
    (row,) = compare.comparisons(med, A)
    assert row["target_met"] is True


def test_compare_starts_each_server_alone_and_reads_its_rss(tmp_path):
    """A started server (superfluid on the toy runtime, a real subprocess): it is up only for
    its turn, and its process group's RSS is read idle and under load."""
    compare = load_compare()
    rc = compare.main(["--runtime", "toy", "--model", "toy", "--concurrency", "1", "--datasets", "chat",
                       "--num-requests", "2", "--output-len", "4", "--repeats", "1", "--skip-prefix",
                       "--superfluid-arg=--runtime-arg=max_seq_len=4096",
                       "--tag", "solo", "--out-dir", str(tmp_path), "--no-progress", "--health-timeout", "120"])
    assert rc == 0
    report = json.loads((tmp_path / "compare_solo.json").read_text())
    assert report["meta"]["one_server_at_a_time"] is True
    (mem,) = report["memory"]
    assert mem["rss_idle_mb"] > 20 and mem["rss_peak_mb"] >= 0.5 * mem["rss_idle_mb"]
    assert report["medians"]["superfluid"]["1"]["chat"]["failed"] == 0
