#!/usr/bin/env python
"""Per-token budget of the serving path at one stream: where the milliseconds between the
runtime's decode step and the client's SSE chunk go.

Each layer of the path is measured on its own, with the same prompt and greedy output
(ignore_eos, --tokens each), every round measuring all of them in turn (servers one at a
time, each alone):

1. ``runtime``: the runtime's step_sampled (TorchRuntime, or LlamaCppRuntime with
   ``--runtime llamacpp``), one lane, one token a step (what the model costs).
2. ``engine``: LLM.generate in this process (scheduler, planner, executor tick, detokenizer,
   stop checks): (t(N tokens) - t(1 token)) / (N - 1).
3. ``server_in_process``: `superfluid serve --in-process` streamed over HTTP (FastAPI, the
   AsyncEngine thread, SSE): (last content chunk - first) / (tokens - 1) at the client.
4. ``server``: `superfluid serve` as users run it (the model in the supervised worker: the
   socket, the shared-memory rings, partial emits): the same figure.

Each layer's own cost is its figure minus the one below it. Writes JSON (the medians, every
run, the machine) to benchmarks/results/path_budget.json and prints a Markdown table.

    .venv/bin/python benchmarks/path_budget.py [--rounds 3] [--tokens 64] [--server-arg=--quant=q4_1]
    .venv/bin/python benchmarks/path_budget.py --model build/rand-1b-q4_k_m.gguf --out benchmarks/results/path_budget_1b.json
    .venv/bin/python benchmarks/path_budget.py --runtime llamacpp --out benchmarks/results/path_budget_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import LOGS, Server, free_port  # noqa: E402  (one server runner for every benchmark)

from superfluid.bench.datasets import make_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("runtime", "engine", "server_in_process", "server")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runtime_ms(rt, prompt_ids: list[int], n: int) -> float:
    from superfluid.runtimes.base import Feed, SampleSpec

    greedy = SampleSpec(0.0, 0, 1.0, 0.0, 0)
    s = rt.seq_create()
    (tok,) = rt.step_sampled([Feed(s, prompt_ids, True)], [greedy])
    t = time.perf_counter()
    for _ in range(n - 1):
        (tok,) = rt.step_sampled([Feed(s, [tok], True)], [greedy])
    el = time.perf_counter() - t
    rt.seq_free(s)
    return el / (n - 1) * 1e3


def engine_ms(llm, messages: list[dict], n: int) -> float:
    from superfluid.engine.params import SamplingParams

    def run(k: int) -> float:
        t = time.perf_counter()
        llm.chat(messages, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - t

    run(1)  # the prompt into the prefix cache, so that both timed runs start from it alike
    one, full = run(1), run(n)
    return (full - one) / (n - 1) * 1e3


def stream_tpot_ms(url: str, messages: list[dict], n: int) -> float:
    """(last content chunk - first) / (tokens - 1) of one stream: the decode cost per token as
    the client sees it (chunks may arrive in bursts, so their median gap would say little)."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    last = time.perf_counter()
                    first = first or last
    if tokens < 2 or first is None:
        raise RuntimeError(f"stream gave {tokens} tokens")
    return (last - first) / (tokens - 1) * 1e3


def server_ms(args, in_process: bool, messages: list[dict]) -> float:
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from superfluid.cli import main; sys.exit(main())", "serve",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *args.server_arg]
    if in_process:
        cmd.append("--in-process")
    srv = Server("superfluid" + ("-in-process" if in_process else ""), f"http://127.0.0.1:{port}", cmd,
                 LOGS / f"path_budget_{'inproc' if in_process else 'worker'}.log")
    srv.start()
    try:
        srv.wait_healthy(300)
        stream_tpot_ms(srv.url, messages, 8)  # warm up (and cache the prompt, as the other layers do)
        return statistics.median(stream_tpot_ms(srv.url, messages, args.tokens) for _ in range(args.streams))
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the default model); the servers get --model too")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=3, help="streams per server per round")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[], help="extra `superfluid serve` argument")
    ap.add_argument("--runtime", default="torch", choices=("torch", "llamacpp"),
                    help="the runtime of every layer (the servers get --runtime too)")
    ap.add_argument("--speculative", action="store_true",
                    help="keep prompt-lookup drafting on in the engine and servers (off by default here: the "
                         "bare runtime layer does not draft, so the layers would not be comparable)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "path_budget.json"))
    args = ap.parse_args()

    import torch

    from superfluid import LLM

    torch.set_num_threads(args.threads)
    req = make_dataset("chat", 1, seed=3, output_len=args.tokens)[0]
    messages = [dict(m) for m in req.messages]
    runs: dict[str, list[float]] = {k: [] for k in LAYERS}
    from superfluid.engine.config import SchedulerConfig

    if not args.speculative:
        args.server_arg.append("--no-speculative")
    args.server_arg.append(f"--runtime={args.runtime}")
    if args.model:
        args.server_arg.append(f"--model={args.model}")
    for rnd in range(args.rounds):
        llm = LLM(args.model, runtime=args.runtime, scheduler=SchedulerConfig(speculative=args.speculative))
        tok = llm.engine.tokenizer
        prompt_ids = tok.encode(tok.apply_chat_template(messages))
        runs["runtime"].append(runtime_ms(llm.engine.ex.prim, prompt_ids, args.tokens))  # the runtime the engine drives
        runs["engine"].append(engine_ms(llm, messages, args.tokens))
        del llm  # free the in-process model before the servers take the machine
        for name, inproc in (("server_in_process", True), ("server", False)):
            runs[name].append(server_ms(args, inproc, messages))
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.2f} ms" for k, v in runs.items()), flush=True)
    med = {k: statistics.median(v) for k, v in runs.items()}
    below = dict(zip(LAYERS[1:], LAYERS[:-1]))
    own = {k: med[k] - (med[below[k]] if k in below else 0.0) for k in LAYERS}
    report = {"benchmark": "path_budget", "model": args.model or "default", "runtime": args.runtime, "cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
              "tokens": args.tokens, "rounds": args.rounds, "server_args": args.server_arg,
              "load_avg": list(os.getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "ms_per_token": med, "own_ms_per_token": own, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{report['cpu']}, {args.threads} threads, median of {args.rounds} rounds\n")
    print("| layer | ms/token at the layer | its own share |\n|---|---:|---:|")
    for k in LAYERS:
        print(f"| {k} | {med[k]:.2f} | {own[k]:+.2f} |")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
