#!/usr/bin/env python
"""Side-by-side serving comparison: superfluid vs llama.cpp's llama-server on the same GGUF.

    .venv/bin/python benchmarks/compare.py --llama-server build/llama-server

Starts ``superfluid serve`` and ``llama-server -m MODEL -np 32 -c 16384 -kvu`` on free
ports (or uses running servers: --superfluid-url / --llama-url), waits for both to be
healthy, warms each up, then for every concurrency (1, 8, 32) and dataset runs the same
requests against both, alternating A/B/A/B over ``--repeats`` rounds so slow drift
(thermal, other load) falls on both. Each (concurrency, round) has its own dataset seed, shared by
both servers, so no server sees a prompt it has cached from an earlier round. Figures are
medians over the rounds. Then, superfluid alone, the shared-prefix dataset against its
cache-defeating twin (a nonce at the start of each system prompt): the TTFT p50 ratio is
what the prefix cache buys.

Writes benchmarks/results/compare_<tag>.json (every run, medians, ratios, targets) and
compare_<tag>.md (the table). With ``--runtime toy`` the superfluid side is the toy
runtime (no model): the output proves the tooling end to end and is labelled as such;
it is not a comparison.
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
TARGETS = {32: 3.0, 8: 2.0, 1: 0.9}
GROUNDED_C1_TARGET = 1.3  # with prompt lookup on
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
    if args.kv_unified:
        # one KV buffer for all slots (llama.cpp's default when -np is not given); without it each of
        # the 32 slots gets 16384/32 = 512 tokens and the 1,000-token shared prompt does not fit
        cmd.append("-kvu")
    cmd += args.llama_arg
    return Server("llama-server", f"http://127.0.0.1:{port}", cmd, LOGS / "llama-server.log")


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


def bench(server: Server, dataset: str, n: int, seed: int, concurrency: int, args, label: str,
          output_len: int | None = None) -> dict:
    reqs = make_dataset(dataset, n, seed, output_len or args.output_len)
    cfg = BenchConfig(base_url=server.url, endpoint=args.endpoint, max_concurrency=concurrency,
                      ignore_eos=args.ignore_eos, seed=seed, label=label, dataset=dataset,
                      progress=not args.no_progress, timeout_s=args.timeout)
    r = run_benchmark(cfg, reqs)
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


def run_matrix(servers: list[Server], args) -> list[dict]:
    runs = []
    for ci, c in enumerate(args.concurrency):
        for ds in args.datasets:
            n = requests_for(c, args)
            for rep in range(args.repeats):
                # a seed per (concurrency, round), shared by both servers: no run replays prompts that
                # an earlier run left in a server's prefix cache (the first n requests of a seed are
                # the same whatever n is)
                seed = args.seed + 1000 * ci + rep
                for s in servers:  # A, B, A, B: the same order every round
                    r = bench(s, ds, n, seed, c, args, f"{s.name} {ds} c={c} round {rep + 1}")
                    runs.append({"server": s.name, "concurrency": c, "dataset": ds, "round": rep, "result": r})
    return runs


def run_prefix(server: Server, args) -> list[dict]:
    runs = []
    for rep in range(args.repeats):
        for ds in ("shared-prefix", "shared-prefix-nocache"):
            r = bench(server, ds, args.prefix_requests, args.seed + 100_000 + rep, 1, args, f"{server.name} {ds} round {rep + 1}",
                      output_len=args.prefix_output_len)
            # a key of its own: the matrix may run shared-prefix at c=1 with other settings
            runs.append({"server": server.name, "concurrency": 1, "dataset": f"prefix/{ds}", "round": rep, "result": r})
    return runs


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
        fig["rounds"] = len(results)
        fig["mean_prompt_tokens"] = median(r["total_input_tokens"] / max(1, r["completed"]) for r in results)
        fig["mean_output_tokens"] = median(r["total_output_tokens"] / max(1, r["completed"]) for r in results)
        tree.setdefault(srv, {}).setdefault(c, {})[ds] = fig
    return tree


def ratio(a, b):
    return a / b if a is not None and b else None


def comparisons(med: dict, args) -> list[dict]:
    sf, ll = med.get("superfluid", {}), med.get("llama-server", {})
    rows = []
    for c in args.concurrency:
        for ds in args.datasets:
            a, b = sf.get(str(c), {}).get(ds), ll.get(str(c), {}).get(ds)
            if a is None:
                continue
            target = GROUNDED_C1_TARGET if (c == 1 and ds == "grounded") else TARGETS.get(c)
            row = {"concurrency": c, "dataset": ds, "superfluid": a, "llama-server": b,
                   "tokens_per_s_ratio": ratio(a["output_tokens_per_s"], b and b["output_tokens_per_s"]),
                   "ttft_p50_ratio": ratio(a["ttft_ms.p50"], b and b["ttft_ms.p50"]),
                   "itl_p50_ratio": ratio(a["itl_ms.p50"], b and b["itl_ms.p50"]),
                   "target_tokens_per_s_ratio": target}
            met = None
            if row["tokens_per_s_ratio"] is not None and target is not None:
                met = row["tokens_per_s_ratio"] >= target
                if c == 32 and row["ttft_p50_ratio"] is not None:
                    met = met and row["ttft_p50_ratio"] <= 1.0  # TTFT p50 no worse
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


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [f"# superfluid vs llama-server — {m['tag']}", ""]
    if m["runtime"] == "toy":
        lines += ["> **Tooling check only — not a comparison.** The superfluid side ran the *toy* runtime "
                  "(no model, no real compute); only the llama-server figures are real model figures.", ""]
    lines += [
        f"- date: {m['date']}, git {m['git']}, host: {m['host']}, load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.1f}' for x in m['loadavg_start'])}, at end {'/'.join(f'{x:.1f}' for x in m['loadavg_end'])}, "
        f"wall {m['wall_s']:.0f}s",
        f"- model: `{m['model_path']}`",
        f"- superfluid: `{m['superfluid_cmd']}`",
        f"- llama-server: `{m['llama_cmd']}` ({m['llama_version']})",
        f"- load: endpoint {m['endpoint']}, ignore_eos {m['ignore_eos']}, output_len {m['output_len']}, "
        f"temperature 0, rounds {m['repeats']} (A/B alternating; medians shown), requests per run "
        f"{m['requests_per_concurrency']}",
        "",
        "Ratios are superfluid / llama-server. tok/s: higher is better for superfluid; TTFT and ITL: lower is.",
        "",
        "| conc | dataset | sf tok/s | llama tok/s | tok/s ratio | target | met | sf TTFT p50 ms | llama TTFT p50 ms "
        "| TTFT ratio | sf ITL p50 ms | llama ITL p50 ms | sf req/s | llama req/s | failed sf/llama |",
        "|---:|---|---:|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["comparison"]:
        a, b = row["superfluid"], row["llama-server"] or {}
        met = {True: "yes", False: "no", None: "–"}[row["target_met"]]
        tgt = f"≥{row['target_tokens_per_s_ratio']}×" if row["target_tokens_per_s_ratio"] else "–"
        if row["concurrency"] == 32 and row["target_tokens_per_s_ratio"]:
            tgt += ", TTFT≤1×"
        lines.append(
            f"| {row['concurrency']} | {row['dataset']} | {fmt(a['output_tokens_per_s'])} | "
            f"{fmt(b.get('output_tokens_per_s'))} | {fmt(row['tokens_per_s_ratio'], '.2f')} | {tgt} | {met} | "
            f"{fmt(a['ttft_ms.p50'])} | {fmt(b.get('ttft_ms.p50'))} | {fmt(row['ttft_p50_ratio'], '.2f')} | "
            f"{fmt(a['itl_ms.p50'])} | {fmt(b.get('itl_ms.p50'))} | {fmt(a['requests_per_s'], '.2f')} | "
            f"{fmt(b.get('requests_per_s'), '.2f')} | {a['failed']}/{b.get('failed', '–')} |")
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
    ap.add_argument("--runtime", default="torch", choices=("torch", "toy"))
    ap.add_argument("--superfluid-arg", action="append", default=[], help="extra `superfluid serve` argument "
                    "(repeatable; use --superfluid-arg=--flag for flags)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    ap.add_argument("--llama-np", type=int, default=32)
    ap.add_argument("--llama-ctx", type=int, default=16384)
    ap.add_argument("--no-kv-unified", dest="kv_unified", action="store_false",
                    help="give each llama-server slot its own ctx/np tokens instead of one shared KV buffer")
    ap.add_argument("--concurrency", default="1,8,32", help="comma-separated")
    ap.add_argument("--datasets", default="chat,grounded,json,shared-prefix", help="comma-separated")
    ap.add_argument("--num-requests", default="", help="per run: N, or N1,N2,... one per concurrency "
                    "(default: 16 at c=1, 32 at c=8, max(64, 2c) above)")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="A/B rounds; medians over them")
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

    model_path = resolve_model(args.model)
    now = datetime.now(timezone.utc)
    tag = args.tag or f"{args.runtime}_{now.strftime('%Y%m%d-%H%M')}"
    sf = superfluid_server(args)
    ll = llama_server(args, model_path)
    servers = [sf] + ([ll] if ll else [])
    notes = list(args.note)
    if args.runtime == "toy":
        notes.insert(0, "superfluid ran --runtime toy: a tooling check, NOT a performance comparison")
    if ll is None:
        notes.append("no llama-server given: superfluid figures only")
    report: dict = {"meta": {
        "tag": tag, "date": now.isoformat(timespec="seconds"), "git": git_rev(),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        "model": args.model, "model_path": str(model_path), "runtime": args.runtime,
        "superfluid_cmd": shlex.join(sf.cmd) if sf.cmd else sf.url,
        "llama_cmd": (shlex.join(ll.cmd) if ll.cmd else ll.url) if ll else None,
        "llama_version": llama_version(args), "endpoint": args.endpoint, "ignore_eos": args.ignore_eos,
        "output_len": args.output_len, "repeats": args.repeats, "concurrency": args.concurrency,
        "datasets": args.datasets, "requests_per_concurrency": {c: requests_for(c, args) for c in args.concurrency},
        "notes": notes,
    }}
    # SIGTERM (and SIGINT, which background shells ignore) still stops both servers via `finally`
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    report["meta"]["loadavg_start"] = os.getloadavg()
    t0 = time.monotonic()
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_healthy(args.health_timeout)
        for s in servers:
            warm_up(s, args)
        runs = [] if args.skip_matrix else run_matrix(servers, args)
        if not args.skip_prefix:
            runs += run_prefix(sf, args)
    finally:
        for s in servers:
            s.stop()
    med = medians(runs)
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
    print(markdown(report))
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
