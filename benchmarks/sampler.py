"""The in-runtime sampler's cost per decode step, against torch's usual sampler measured in
the same run, as a ratio.

Ours: ``runtimes/torch/sample.sample_lanes`` with no flags (on a CPU, the host's integer-
weight walk lane by lane). The baseline: what engines built on torch commonly do per step,
batched: logits / temperature, top-k by ``torch.topk``, top-p by a full ``torch.sort`` and a
cumulative softmax, min-p against the max probability, then ``torch.multinomial``
(vLLM's and transformers' shape of sampler). Rows are random normal logits (std 3) at the
vocabularies users run (SmolLM2 49,152; Llama 3 128,256; Qwen3 151,936); lanes 1 and 32;
settings: temperature 1 alone, top-p 0.9 at temperature 0.7, top-k 40, min-p 0.05.
Figures are milliseconds per step (one row per lane), medians of --repeats.

    .venv/bin/python benchmarks/sampler.py [--repeats 15] [--out benchmarks/results/sampler.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from superfluid.runtimes.base import SampleSpec
from superfluid.runtimes.torch.heap import keep_step_heap
from superfluid.runtimes.torch.sample import sample_lanes

SETTINGS = {"temperature_1": SampleSpec(1.0, 0, 1.0, 0.0, 0), "top_p_0.9": SampleSpec(0.7, 0, 0.9, 0.0, 0),
            "top_k_40": SampleSpec(0.7, 40, 1.0, 0.0, 0), "min_p_0.05": SampleSpec(1.0, 0, 1.0, 0.05, 0)}


def torch_usual(logits: torch.Tensor, spec: SampleSpec) -> list[int]:
    x = logits / spec.temperature
    if spec.top_k:
        kth = torch.topk(x, spec.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, -torch.inf)
    if spec.top_p < 1.0:
        s, idx = torch.sort(x, dim=-1, descending=True)
        cum = s.softmax(-1).cumsum(-1)
        drop = cum - s.softmax(-1) > spec.top_p
        x = x.scatter(1, idx, s.masked_fill(drop, -torch.inf))
    p = x.softmax(-1)
    if spec.min_p > 0.0:
        p = p.masked_fill(p < spec.min_p * p.amax(-1, keepdim=True), 0.0)
    return torch.multinomial(p, 1)[:, 0].tolist()


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sampler.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    keep_step_heap()  # as a runtime's process runs
    g = torch.Generator().manual_seed(0)
    rows = []
    for vocab in (49152, 128256, 151936):
        for lanes in (1, 32):
            logits = torch.randn(lanes, vocab, generator=g) * 3
            for name, spec in SETTINGS.items():
                specs = [SampleSpec(spec.temperature, spec.top_k, spec.top_p, spec.min_p, i) for i in range(lanes)]
                ours = median_ms(lambda: sample_lanes(logits, specs), args.repeats)
                base = median_ms(lambda: torch_usual(logits, spec), args.repeats)
                rows.append({"vocab": vocab, "lanes": lanes, "setting": name, "ours_ms": ours,
                             "torch_usual_ms": base, "speedup": base / ours})
                print(f"V={vocab:6d} lanes={lanes:2d} {name:14s} ours {ours:7.2f} ms  torch usual {base:7.2f} ms"
                      f"  {base / ours:5.2f}x", flush=True)
    report = {"benchmark": "sampler", "threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
