#!/usr/bin/env python
"""Where a batched workload's seconds go, layer by layer: what stands between the
runtime's own speed and the server's output tok/s at concurrency C.

The same chat requests (superfluid.bench.datasets "chat": their messages and max_tokens,
greedy, ignore_eos) run:

1. ``engine``: in this process, through LLM's engine with ``max_running = C`` (every
   request queued at once, so the batch stays full). An executor wrapper records every
   tick: its wall time, the executor's own prefill and decode nanoseconds
   (TickEvents.timings), its prefill tokens and decode lanes. What the ticks do not
   cover is the scheduler, planner and detokenizer (the engine's Python).
2. ``server``: `superfluid serve` (the model in its worker, as users run it) driven at
   concurrency C by superfluid.bench.serve over HTTP with SSE.

The table splits the engine's wall time into prefill, decode, the rest of the tick
(validation, capacity, cache, events) and the engine outside ticks; the server's extra
time over the engine is the HTTP/SSE/worker path. JSON to
benchmarks/results/batch_profile.json.

    .venv/bin/python benchmarks/batch_profile.py [--concurrency 32] [--requests 64] [--output-len 64] [--no-server]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import LOGS, Server, cpu_name, free_port  # noqa: E402  (one server runner for every benchmark)

from superfluid import LLM, SamplingParams  # noqa: E402
from superfluid.bench.datasets import make_dataset  # noqa: E402
from superfluid.bench.serve import BenchConfig, run_benchmark  # noqa: E402
from superfluid.engine.config import SchedulerConfig  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


class TickTimer:
    """An executor wrapper that times every tick it runs (nothing else changes)."""

    def __init__(self, ex):
        self.ex = ex
        self.ticks: list[dict] = []

    def __getattr__(self, name):
        return getattr(self.ex, name)

    def run_tick(self, plan, on_partial_emit=None):
        t0 = time.perf_counter_ns()
        out = self.ex.run_tick(plan, on_partial_emit)
        wall = time.perf_counter_ns() - t0
        if out.events is not None:
            t = out.events.timings
            self.ticks.append({
                "wall_ns": wall, "total_ns": t.wall_ns, "prefill_ns": t.prefill_ns, "decode_ns": t.decode_ns,
                "prefill_tokens": sum(p.token_count for p in plan.prefills),
                "decode_lanes": sum(1 for d in plan.decodes if d.max_new_tokens > 0),
                "tokens": sum(e.n_tokens for e in out.events.emits),
            })
        return out


def engine_run(reqs, concurrency: int) -> dict:
    """The dataset's requests as the server gets them: their messages, their max_tokens."""
    llm = LLM(scheduler=SchedulerConfig(max_running=concurrency))
    timer = TickTimer(llm.engine.ex)
    llm.engine.ex = llm.engine.scheduler.ex = timer
    prompts = [[dict(m) for m in r.messages] for r in reqs]
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs]
    llm.chat(prompts[:concurrency], params[:concurrency])  # warm-up: kernels, caches, the gate's first samples
    timer.ticks.clear()
    t0 = time.perf_counter()
    outs = llm.chat(prompts, params)
    wall = time.perf_counter() - t0
    llm.close()
    ticks = timer.ticks
    ns = lambda k: sum(t[k] for t in ticks) / 1e9  # noqa: E731
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_ticks = [t for t in ticks if t["decode_lanes"] >= concurrency // 2 and t["prefill_tokens"] == 0]
    per_round = [t["decode_ns"] / 1e6 / max(t["tokens"] / max(t["decode_lanes"], 1), 1) for t in decode_ticks]
    return {
        "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "ticks": len(ticks),
        "prefill_s": ns("prefill_ns"), "decode_s": ns("decode_ns"),
        "tick_rest_s": ns("total_ns") - ns("prefill_ns") - ns("decode_ns"),
        "outside_executor_s": ns("wall_ns") - ns("total_ns"),  # the worker hop, if any (none in-process)
        "engine_python_s": wall - ns("wall_ns"),
        "prefill_tokens": sum(t["prefill_tokens"] for t in ticks),
        "prefill_tok_s": sum(t["prefill_tokens"] for t in ticks) / max(ns("prefill_ns"), 1e-9),
        "full_batch_round_ms_p50": statistics.median(per_round) if per_round else None,
    }


def server_run(reqs, concurrency: int) -> dict:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from superfluid.cli import main; sys.exit(main())", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    srv = Server("superfluid", f"http://127.0.0.1:{port}", cmd, LOGS / "batch_profile_server.log")
    srv.start()
    try:
        srv.wait_healthy(300)
        cfg = BenchConfig(base_url=srv.url, max_concurrency=concurrency, endpoint="chat", ignore_eos=True,
                          temperature=0.0, progress=False)
        run_benchmark(cfg, reqs[:concurrency])  # warm-up
        r = run_benchmark(cfg, reqs)
    finally:
        srv.stop()
    return {"wall_s": r["duration_s"], "tokens": r["total_output_tokens"], "tok_s": r["output_tokens_per_s"],
            "ttft_p50_ms": r["ttft_ms"]["p50"], "itl_p50_ms": r["itl_ms"]["p50"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--no-server", action="store_true")
    a = ap.parse_args()
    reqs = make_dataset("chat", a.requests, output_len=a.output_len)
    eng = engine_run(reqs, a.concurrency)
    srv = None if a.no_server else server_run(reqs, a.concurrency)
    out = {"cpu": cpu_name(), "host": platform.node(), "concurrency": a.concurrency, "requests": a.requests,
           "output_len": a.output_len, "engine": eng, "server": srv}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "batch_profile.json").write_text(json.dumps(out, indent=2))
    w = eng["wall_s"]
    rows = [("prefill (runtime steps)", eng["prefill_s"]), ("decode (runtime steps, sampling)", eng["decode_s"]),
            ("rest of the tick (validate, capacity, cache, events)", eng["tick_rest_s"]),
            ("engine outside ticks (scheduler, planner, detokenizer)", eng["engine_python_s"])]
    print(f"CPU: {out['cpu']}; c={a.concurrency}, {a.requests} chat requests x {a.output_len} tokens\n")
    print("| where | s | share of the engine's wall |\n|---|---:|---:|")
    for name, s in rows:
        print(f"| {name} | {s:.2f} | {s / w:.0%} |")
    print(f"| **engine, in process** | {w:.2f} | {eng['tok_s']:.1f} tok/s |")
    if srv is not None:
        print(f"| **server** (the engine in its worker, HTTP, SSE) | {srv['wall_s']:.2f} | {srv['tok_s']:.1f} tok/s "
              f"({srv['tok_s'] / eng['tok_s']:.2f}x the engine; TTFT p50 {srv['ttft_p50_ms']:.0f} ms) |")
    print(f"\nprefill {eng['prefill_tokens']} tokens at {eng['prefill_tok_s']:.0f} tok/s; a full-batch decode round "
          f"{eng['full_batch_round_ms_p50']} ms (p50)")


if __name__ == "__main__":
    main()
