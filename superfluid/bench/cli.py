"""``superfluid bench serve|offline|dataset`` (also ``python -m superfluid.bench ...``).

Wiring into the main CLI:

    from superfluid.bench.cli import add_parsers
    add_parsers(subparsers)          # adds "bench" with serve / offline / dataset under it
    ...
    return args.func(args)           # each handler returns an exit code

``add_bench_subcommands(subparsers)`` adds serve / offline / dataset directly, for a
parser that is already the ``bench`` level.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from .datasets import DATASETS


def add_parsers(subparsers) -> argparse.ArgumentParser:
    bench = subparsers.add_parser("bench", help="benchmarks: serving load generator, offline throughput",
                                  description="Benchmarks: `bench serve` (any OpenAI-compatible server), "
                                              "`bench offline` (LLM.generate vs transformers), `bench dataset`.")
    add_bench_subcommands(bench.add_subparsers(dest="bench_command", required=True))
    return bench


def add_bench_subcommands(subparsers) -> None:
    s = subparsers.add_parser("serve", help="load-test an OpenAI-compatible server",
                              description="Stream a generated dataset at an OpenAI-compatible endpoint and report "
                                          "output tokens/s, requests/s, TTFT / ITL / TPOT / E2E percentiles and "
                                          "cached prompt tokens.")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (with or without /v1)")
    s.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    s.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    s.add_argument("--dataset", choices=DATASETS, default="chat")
    s.add_argument("--num-requests", "-n", type=int, default=64)
    s.add_argument("--output-len", type=int, default=128, help="max_tokens (chat: the upper end of its range)")
    s.add_argument("--concurrency", "-c", type=int, default=8, help="requests in flight at most; 0: unbounded")
    s.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default inf: send as concurrency allows)")
    s.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos=true so every output runs to max_tokens (superfluid, vLLM and "
                        "llama-server accept it; not sent for JSON requests)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--extra-body", default="{}", help="JSON merged into every request body, e.g. '{\"top_k\": 1}'")
    s.add_argument("--seed", type=int, default=0, help="dataset and arrival seed")
    s.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    s.add_argument("--label", default="")
    s.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    s.add_argument("--keep-requests", action="store_true", help="per-request records in the JSON")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(func=cmd_serve)

    o = subparsers.add_parser("offline", help="LLM.generate throughput vs transformers on the same weights")
    o.add_argument("--model", default="SmolLM2-135M-Instruct")
    o.add_argument("--runtime", default="auto")
    o.add_argument("--dtype", default=None, help="superfluid's dtype (default: the runtime's)")
    o.add_argument("--hf-dtype", default="float32")
    o.add_argument("--num-prompts", type=int, default=16)
    o.add_argument("--output-len", type=int, default=64)
    o.add_argument("--dataset", choices=DATASETS, default="chat")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--hf-batch-size", type=int, default=16)
    o.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    o.add_argument("--max-prompt-tokens", type=int, default=0, help="keep each prompt's last N tokens (0: all)")
    o.add_argument("--skip-hf", action="store_true", help="superfluid only")
    o.add_argument("--out", type=Path, default=None)
    o.set_defaults(func=cmd_offline)

    from .fidelity import add_parser as add_fidelity

    add_fidelity(subparsers)
    d = subparsers.add_parser("dataset", help="print a benchmark dataset as JSON lines")
    d.add_argument("name", choices=DATASETS)
    d.add_argument("--num-requests", "-n", type=int, default=8)
    d.add_argument("--output-len", type=int, default=128)
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_dataset)


def _write(path: Path | None, result: dict) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def cmd_serve(args) -> int:
    from .datasets import make_dataset
    from .serve import BenchConfig, format_result, run_benchmark

    try:
        extra = json.loads(args.extra_body)
    except json.JSONDecodeError as e:
        print(f"error: --extra-body is not JSON: {e}", file=sys.stderr)
        return 2
    requests = make_dataset(args.dataset, args.num_requests, args.seed, args.output_len)
    config = BenchConfig(
        base_url=args.base_url, model=args.model, endpoint=args.endpoint,
        max_concurrency=args.concurrency or None, request_rate=args.request_rate, ignore_eos=args.ignore_eos,
        temperature=args.temperature, extra_body=extra, seed=args.seed, timeout_s=args.timeout,
        label=args.label, dataset=args.dataset, progress=not args.no_progress, keep_requests=args.keep_requests,
    )
    result = run_benchmark(config, requests)
    print(format_result(result))
    _write(args.out, result)
    return 0 if result["completed"] else 1


def cmd_offline(args) -> int:
    from .offline import OfflineConfig, format_offline, run_offline

    cfg = OfflineConfig(model=args.model, runtime=args.runtime, dtype=args.dtype, hf_dtype=args.hf_dtype,
                        num_prompts=args.num_prompts, output_len=args.output_len, dataset=args.dataset,
                        seed=args.seed, hf_batch_size=args.hf_batch_size, threads=args.threads, skip_hf=args.skip_hf,
                        max_prompt_tokens=args.max_prompt_tokens)
    result = run_offline(cfg)
    print(format_offline(result))
    _write(args.out, result)
    return 0


def cmd_dataset(args) -> int:
    from .datasets import dump_jsonl, make_dataset

    print(dump_jsonl(make_dataset(args.name, args.num_requests, args.seed, args.output_len)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m superfluid.bench", description=__doc__.splitlines()[0])
    add_bench_subcommands(ap.add_subparsers(dest="bench_command", required=True))
    args = ap.parse_args(argv)
    return args.func(args)
