"""Long prompts on the default route: where the seconds go (issue 31).

Two figures, each for the native kernels built as this CPU allows (512-bit attention where it has
AVX-512) and, as the baseline in the same run, the 256-bit build (SUPERFLUID_KERNELS_NO_AVX512=1),
each in a process of its own, one after the other:

- attention, per layer: ``kernels.attend_decode`` over the last 512-row chunk of a prompt of each
  length (a prefill chunk's tile), and over 32 decode lanes of 400 keys each, at a model's head shape
  (the default model's by default: H 9, Hkv 3, d 64), scattered cells, median of --repeats;
- time to first token of ``LLM()`` (no flags: the default model, route and kernels) for one prompt
  of each length (README text, max_tokens=1), median of --repeats.

    .venv/bin/python benchmarks/long_prompt.py --lengths 1024,2048,4096 --repeats 3

Writes benchmarks/results/long_prompt_<tag>.json and prints a table with the ratio (512 / 256-bit).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 512


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def _median_s(fn, repeats: int) -> float:
    fn()  # warm (the kernels build on first use)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _attention(lengths: list[int], repeats: int, H: int, Hkv: int, d: int) -> dict:
    import torch

    from superfluid.runtimes.torch import kernels

    g = torch.Generator().manual_seed(0)
    out = {}
    for n in lengths:
        start = max(0, n - CHUNK)
        S = n + 16
        kc, vc = torch.randn(S, Hkv, d, generator=g), torch.randn(S, Hkv, d, generator=g)
        q = torch.randn(n - start, H, d, generator=g)
        gather = torch.randperm(S, generator=g)[:n].expand(n - start, n).contiguous()
        lens = torch.arange(start + 1, n + 1)
        first = torch.zeros(n - start, dtype=torch.int64)
        out[f"chunk_{n}_ms"] = 1e3 * _median_s(
            lambda: kernels.attend_decode(q, kc, vc, gather, first, lens, check_cells=False), repeats)
    B, L = 32, 400
    kc, vc = torch.randn(B * L, Hkv, d, generator=g), torch.randn(B * L, Hkv, d, generator=g)
    q = torch.randn(B, H, d, generator=g)
    gather = torch.randperm(B * L, generator=g).view(B, L).contiguous()
    lens, first = torch.full((B,), L), torch.zeros(B, dtype=torch.int64)
    out["decode_32x400_ms"] = 1e3 * _median_s(
        lambda: kernels.attend_decode(q, kc, vc, gather, first, lens, check_cells=False), 10 * repeats)
    return out


def _ttft(lengths: list[int], repeats: int) -> dict:
    from superfluid import LLM, SamplingParams

    llm = LLM()
    ids = llm.tokenizer.encode((ROOT / "README.md").read_text() * 8)
    p = SamplingParams(max_tokens=1, temperature=0)
    calls = iter(range(10**6))

    def one(n: int) -> None:
        # Every call starts at another place in the text, so that no prompt shares a prefix
        # with one before it: the prefix cache must not serve any of it.
        at = next(calls) * 997 % (len(ids) - n)
        llm.generate([ids[at: at + n]], p, use_tqdm=False)

    if len(ids) < 2 * max(lengths):
        raise SystemExit(f"the README gives {len(ids)} tokens, too few for {max(lengths)}")
    out = {f"ttft_{n}_s": _median_s(lambda: one(n), repeats) for n in lengths}
    out["prefix_hit_tokens"] = llm.engine.scheduler.stats.prefix_hit_tokens  # 0: nothing was served from cache
    return out


def _worker(args) -> None:
    got = _attention(args.lengths, args.repeats, args.heads, args.kv_heads, args.head_dim)
    if not args.skip_ttft:
        got |= _ttft(args.lengths, args.repeats)
    print("RESULT " + json.dumps(got), flush=True)


def _run(args, no_512: bool) -> dict:
    env = dict(os.environ, SUPERFLUID_KERNELS_NO_AVX512="1" if no_512 else "")
    cmd = [sys.executable, __file__, "--worker", "--lengths", ",".join(map(str, args.lengths)),
           "--repeats", str(args.repeats), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
           "--head-dim", str(args.head_dim)] + (["--skip-ttft"] if args.skip_ttft else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"the worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,2048,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--skip-ttft", action="store_true", help="only the attention kernel")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",") if x]
    if args.worker:
        return _worker(args)
    fast, base = _run(args, no_512=False), _run(args, no_512=True)
    result = {"cpu": _cpu(), "cores": os.cpu_count(), "repeats": args.repeats, "medians": True,
              "head_shape": [args.heads, args.kv_heads, args.head_dim], "native": fast, "baseline_256bit": base,
              "ratio": {k: fast[k] / base[k] for k in fast if k.endswith(("_ms", "_s"))}}
    out = ROOT / "benchmarks/results" / f"long_prompt_{args.tag or time.strftime('%Y%m%dT%H%M%S')}.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"CPU: {result['cpu']}, {result['cores']} cores; medians of {args.repeats}; ratio = native / 256-bit build")
    for k in fast:
        print(f"  {k:22s} {fast[k]:9.2f}  {base[k]:9.2f}  {result['ratio'].get(k, float('nan')):.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
