"""Torch runtime step speed against transformers, measured in the same run.

Figures (tokens per second, median of --repeats):
- prefill: one 512-token prompt; ours: one step(); transformers: one forward().
- decode@32: 32 sequences of 32-token prompts; ours: greedy step_sampled() rounds;
  transformers: generate(batch 32). Prefill is excluded on both sides
  (transformers: generate(N + 1 new) minus generate(1 new)).
- decode@1: the same with one sequence.
Each figure is also written as a ratio ours / transformers. Transformers runs in bf16
(its reference setting); ours in --dtype (default: the runtime's default for this CPU), and
with --quant also in each quant mode (native kernels, block-quantized decode weights).
Every repeat runs all sides in turn, so a change of machine load hits them alike.

    .venv/bin/python benchmarks/runtime_step.py [--dtype float32|bfloat16] [--quant q8_0,q4_1]
        [--deterministic] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from superfluid.models import DEFAULT_MODEL, resolve_model
from superfluid.runtimes.base import Feed, SampleSpec
from superfluid.runtimes.torch import TorchRuntime

GREEDY = SampleSpec(0.0, 0, 1.0, 0.0, 0)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours_prefill(rt, tokens) -> float:
    s = rt.seq_create()
    el = timed(lambda: rt.step([Feed(s, tokens, True)]))
    rt.seq_free(s)
    return len(tokens) / el


def ours_decode(rt, prompts, n_new) -> float:
    seqs = [rt.seq_create() for _ in prompts]
    toks = rt.step_sampled([Feed(s, p, True) for s, p in zip(seqs, prompts)], [GREEDY] * len(seqs))

    def rounds():
        nonlocal toks
        for _ in range(n_new):
            toks = rt.step_sampled([Feed(s, [t], True) for s, t in zip(seqs, toks)], [GREEDY] * len(seqs))

    el = timed(rounds)
    for s in seqs:
        rt.seq_free(s)
    return len(prompts) * n_new / el


def hf_prefill(hf, tokens) -> float:
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        return len(tokens) / timed(lambda: hf(ids))


def hf_decode(hf, prompts, n_new) -> float:
    ids = torch.tensor(prompts)
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        one = timed(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw))
        full = timed(lambda: hf.generate(ids, max_new_tokens=n_new + 1, min_new_tokens=n_new + 1, **kw))
    return len(prompts) * n_new / max(full - one, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--quant", default="", help="also measure these quant modes, comma-separated (q8_0,q4_1)")
    ap.add_argument("--deterministic", action="store_true", help="also measure the batch-invariant mode")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "runtime_step.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    variants = {"ours": TorchRuntime(args.model, dtype=args.dtype, quant="none")}
    if args.deterministic:
        variants["ours_deterministic"] = TorchRuntime(args.model, dtype=args.dtype, quant="none", deterministic=True)
    for q in filter(None, args.quant.split(",")):
        variants[f"ours_{q}"] = TorchRuntime(args.model, quant=q)
        if args.deterministic:
            variants[f"ours_deterministic_{q}"] = TorchRuntime(args.model, quant=q, deterministic=True)
    path = resolve_model(args.model)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval() \
        if path.suffix == ".gguf" else AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    prompt512 = rng.integers(100, 40000, 512).tolist()
    p32 = [rng.integers(100, 40000, 32).tolist() for _ in range(32)]
    cases = {
        "prefill_512": (lambda rt: ours_prefill(rt, prompt512), lambda: hf_prefill(hf, prompt512)),
        "decode_32": (lambda rt: ours_decode(rt, p32, 16), lambda: hf_decode(hf, p32, 16)),
        "decode_1": (lambda rt: ours_decode(rt, p32[:1], 32), lambda: hf_decode(hf, p32[:1], 32)),
    }
    results = {}
    for name, (ours, theirs) in cases.items():
        for rt in variants.values():
            ours(rt)  # warm up
        theirs()
        runs: dict[str, list[float]] = {k: [] for k in variants}
        b = []
        for _ in range(args.repeats):  # alternate, so drifting machine load hits every side alike
            for k, rt in variants.items():
                runs[k].append(ours(rt))
            b.append(theirs())
        base = statistics.median(b)
        results[name] = {"transformers_tok_s": base, "transformers_all": b}
        line = f"{name:12s} transformers {base:8.1f} tok/s"
        for k, a in runs.items():
            med = statistics.median(a)
            results[name][k] = {"tok_s": med, "ratio": med / base, "all": a}
            line += f" | {k} {med:8.1f} ({med / base:.2f}x)"
        print(line, flush=True)
    report = {
        "benchmark": "runtime_step", "model": str(args.model), "ours_dtype": str(variants["ours"].dtype),
        "variants": [k for k in variants if k != "ours"],
        "transformers_dtype": "torch.bfloat16", "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "load_avg": list(__import__("os").getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
