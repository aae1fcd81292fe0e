"""Torch runtime step speed against transformers, measured in the same run.

Figures (tokens per second, median of --repeats):
- prefill: one 512-token prompt; ours: one step(); transformers: one forward().
- decode@32: 32 sequences of 32-token prompts; ours: greedy step_sampled() rounds;
  transformers: generate(batch 32). Prefill is excluded on both sides
  (transformers: generate(N + 1 new) minus generate(1 new)).
- decode@1: the same with one sequence.
Each figure is also written as a ratio ours / transformers. Transformers runs in bf16
(its reference setting); ours with no flags (``ours_default``: the file's own blocks on the
native kernels, the invariant route), in --dtype (default: the runtime's default for this CPU), and
with --quant also in each quant mode (native kernels, block-quantized decode weights).
Every repeat runs all sides in turn, so a change of machine load hits them alike.

Machine limits, measured in the same run (``limits`` in the JSON): memory bandwidth (a
64 MiB copy), fp32 GEMM (torch, [512, 576] x [576, 3072]) and the native q4_1 / q8_0 GEMV
on the model's FFN shape at 1, 8, 32 and 512 rows. Each quant figure is then set against
them: decode@1 as the weight bytes a token streams over the bandwidth, prefill and
decode@32 as their multiply-adds over the GEMV's rate at that many rows.

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


def _median_secs(fn, n: int = 7) -> float:
    fn()
    return statistics.median(timed(fn) for _ in range(n))


def machine_limits() -> dict:
    """What this machine can do for the shapes a step is made of (see the module doc)."""
    from superfluid.runtimes.torch import kernels

    a = torch.empty(16 * 2 ** 20)
    b = torch.empty_like(a)
    out = {"copy_gb_s": 2 * a.numel() * 4 / _median_secs(lambda: b.copy_(a)) / 1e9}
    x, w = torch.randn(512, 576), torch.randn(3072, 576)
    out["fp32_gemm_gflop_s"] = 2 * 512 * 576 * 3072 / _median_secs(lambda: x @ w.T) / 1e9
    if kernels.native() is not None:
        for kind in ("q4_1", "q8_0"):
            m = kernels.QMat(w, kind)
            for rows in (1, 8, 32, 512):
                xr = torch.randn(rows, 576)
                out[f"{kind}_gemv_gmac_s@{rows}"] = rows * 3072 * 576 / _median_secs(lambda: kernels.gemv(xr, m)) / 1e9
    return out


def against_limits(rt, results: dict, name: str, limits: dict) -> dict:
    """Share of the machine's limit each figure of a quant variant reaches."""
    model = rt.model
    kind = model.layers[0].wqkv.q.kind if model.layers[0].wqkv.q is not None else None
    if kind is None or f"{kind}_gemv_gmac_s@1" not in limits:
        return {}
    layer_macs = sum(m.q.N * m.q.K for L in model.layers for m in (L.wqkv, L.wo, L.wgu, L.wdown))
    head = model.lm_head.q
    token_bytes = sum(m.q.nbytes for L in model.layers for m in (L.wqkv, L.wo, L.wgu, L.wdown)) + head.nbytes
    d1, d32 = results["decode_1"][name]["tok_s"], results["decode_32"][name]["tok_s"]
    pre = results["prefill_512"][name]["tok_s"]
    return {
        "decode_1_bandwidth_share": d1 * token_bytes / 1e9 / limits["copy_gb_s"],
        "decode_32_gemv_share": d32 * (layer_macs + head.N * head.K) / 1e9 / limits[f"{kind}_gemv_gmac_s@32"],
        "prefill_512_gemv_share": pre * layer_macs / 1e9 / limits[f"{kind}_gemv_gmac_s@512"],
        "token_weight_mb": token_bytes / 1e6,
    }


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
    variants = {"ours_default": TorchRuntime(args.model),  # no flags: what LLM() and serve run
                "ours": TorchRuntime(args.model, dtype=args.dtype, quant="none")}
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
    limits = machine_limits()
    print("limits", {k: round(v, 1) for k, v in limits.items()}, flush=True)
    shares = {k: against_limits(rt, results, k, limits) for k, rt in variants.items()}
    for k, v in shares.items():
        if v:
            print(f"{k}: " + ", ".join(f"{a} {b:.2f}" for a, b in v.items()), flush=True)
    report = {
        "benchmark": "runtime_step", "model": str(args.model), "ours_dtype": str(variants["ours"].dtype),
        "variants": [k for k in variants if k != "ours"],
        "transformers_dtype": "torch.bfloat16", "threads": args.threads, "repeats": args.repeats,
        "torch": torch.__version__, "machine": platform.processor() or platform.machine(),
        "load_avg": list(__import__("os").getloadavg()), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": results, "limits": limits, "limit_shares": {k: v for k, v in shares.items() if v},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
