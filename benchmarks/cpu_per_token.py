#!/usr/bin/env python
"""CPU time per streamed token, process by process, at one stream: what each process of a
server (and the client) spends for every token it streams.

Starts one server (superfluid, or llama-server on the same GGUF), warms it up, then streams
``--streams`` greedy chat requests of ``--tokens`` tokens (ignore_eos) one after another and
reads every process's CPU time (user + system) under the server before and after. Prints ms
of CPU per token for each process and the client, and the stream's time per output token
(last chunk - first, / tokens - 1, median over streams).

    .venv/bin/python benchmarks/cpu_per_token.py superfluid --runtime llamacpp
    .venv/bin/python benchmarks/cpu_per_token.py llama-server --llama-server build/llama-server
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import LOGS, Server, free_port  # noqa: E402

from superfluid.bench.datasets import make_dataset  # noqa: E402
from superfluid.models import DEFAULT_MODEL, resolve_model  # noqa: E402


def cpu_seconds(root: int) -> dict[int, tuple[str, float]]:
    out = {}
    try:
        procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = (" ".join(p.cmdline()[:6])[-70:], t.user + t.system)
        except psutil.Error:
            pass
    return out


def stream(url: str, messages: list[dict], n: int) -> tuple[int, float]:
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "messages": messages, "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    chunks, first, last = 0, None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            # Only chunks that carry text: superfluid sends its role chunk when the request
            # starts (before the prefill) and llama-server with the first token, so timing
            # every chunk would charge one server its prefill and not the other.
            if not any((c.get("delta") or {}).get("content") for c in json.loads(line[6:]).get("choices") or ()):
                continue
            chunks += 1
            last = time.perf_counter()
            first = first or last
    return chunks, (last - first) / max(chunks - 1, 1) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("server", choices=("superfluid", "llama-server"))
    ap.add_argument("--llama-server", type=Path, default=Path("build/llama-server"))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args, extra = ap.parse_known_args()
    port = free_port()
    if args.server == "llama-server":
        cmd = [str(args.llama_server), "-m", str(resolve_model(DEFAULT_MODEL)), "-np", "8", "-c", "16384", "-kvu",
               "--host", "127.0.0.1", "--port", str(port), *extra]
    else:
        cmd = [sys.executable, "-c", "import sys; from superfluid.cli import main; sys.exit(main())", "serve",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
    srv = Server(args.server, f"http://127.0.0.1:{port}", cmd, LOGS / f"cpu_per_token_{args.server}.log")
    srv.start()
    try:
        srv.wait_healthy(300)
        messages = [dict(m) for m in make_dataset("chat", 1, seed=3, output_len=args.tokens)[0].messages]
        stream(srv.url, messages, 8)  # warm up; the prompt is cached from here on, on both servers
        time.sleep(1)
        me = psutil.Process()
        before, mine = cpu_seconds(srv.proc.pid), me.cpu_times()
        runs = [stream(srv.url, messages, args.tokens) for _ in range(args.streams)]
        after, mine2 = cpu_seconds(srv.proc.pid), me.cpu_times()
        tokens = sum(k for k, _ in runs)
        print(f"{args.server}: {tokens} chunks, time per output token {statistics.median(t for _, t in runs):.2f} ms")
        for pid, (name, t) in after.items():
            print(f"  {pid:>7} {name:70s} {(t - before.get(pid, ('', 0.0))[1]) / tokens * 1e3:7.2f} ms CPU/token")
        client = (mine2.user + mine2.system) - (mine.user + mine.system)
        print(f"  {'client':>7} {'(this process)':70s} {client / tokens * 1e3:7.2f} ms CPU/token")
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
