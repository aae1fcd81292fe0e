"""How close a route's numbers are to the file's own: teacher-forced scoring of a fixed text.

For one GGUF file, each route under test (our default, the ``gguf`` route; llama.cpp through
the ``llamacpp`` runtime) and the reference (the fp32 dequantization of the same file,
``--quant none``) read the same token sequence in one feed; per position we compare the
next-token distributions: KL(reference || route) in nats, and whether the argmax agrees.
The same tokens, the same weights: what differs is only each route's arithmetic.

    python -m superfluid.bench fidelity --model FILE.gguf [--tokens 256] [--json out.json]
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..runtimes.base import Feed


@dataclass(frozen=True)
class Score:
    route: str
    kl_mean: float  # nats per token, KL(reference || route)
    kl_p99: float
    top1: float  # share of positions whose argmax equals the reference's
    positions: int


def logits(rt, tokens: list[int]) -> np.ndarray:
    """[len(tokens), V] float64 rows of one teacher-forced feed."""
    seq = rt.seq_create()
    try:
        return np.stack(rt.step_rows([Feed(seq, list(tokens), True)])[0]).astype(np.float64)
    finally:
        rt.seq_free(seq)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def score(route: str, got: np.ndarray, ref: np.ndarray) -> Score:
    lp, lq = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return Score(route, float(kl.mean()), float(np.quantile(kl, 0.99)), float(np.mean(got.argmax(-1) == ref.argmax(-1))),
                 len(kl))


def text_tokens(tokenizer, n: int, seed: int = 0) -> list[int]:
    """n tokens of a fixed text: prose where the vocabulary has it, cycled; seeded random ids
    for tiny vocabularies that cannot spell it."""
    prose = (Path(__file__).with_name("datasets.py").read_text())  # any fixed English-ish text in the package
    ids = tokenizer.encode(prose)
    if len(ids) < n:
        ids = np.random.default_rng(seed).integers(3, tokenizer.vocab_size, n).tolist()
    return ids[:n]


def compare(path: Path, n_tokens: int = 256, llama_kv_f32: bool = False) -> dict:
    """Scores of our default route and llama.cpp's against ``--quant none`` on one file."""
    from ..runtimes.llamacpp.runtime import LlamaCppRuntime
    from ..runtimes.torch import TorchRuntime

    ref_rt = TorchRuntime(path, quant="none", dtype="float32", kv_cache_mb=64)
    toks = text_tokens(ref_rt.tokenizer, n_tokens)
    ref = logits(ref_rt, toks)
    del ref_rt
    ours_rt = TorchRuntime(path, kv_cache_mb=64)
    ours = score(f"superfluid {ours_rt.desc.runtime_id.split(':', 4)[-1]}", logits(ours_rt, toks), ref)
    del ours_rt
    lc = LlamaCppRuntime(path, max_batch=4, n_ctx=max(512, 2 * n_tokens), kv_f32=llama_kv_f32)
    theirs = score("llama.cpp" + (" (f32 KV)" if llama_kv_f32 else ""), logits(lc, toks), ref)
    return {"file": path.name, "tokens": len(toks), "ours": asdict(ours), "llama.cpp": asdict(theirs)}


def add_parser(subparsers) -> None:
    f = subparsers.add_parser("fidelity", help="teacher-forced KL / top-1 of our default route and llama.cpp "
                                               "against the file's fp32 dequantization")
    f.add_argument("--model", type=Path, required=True, action="append", help="a .gguf file (repeatable)")
    f.add_argument("--tokens", type=int, default=256)
    f.add_argument("--llama-kv-f32", action="store_true", help="llama.cpp with fp32 K/V (default: its fp16)")
    f.add_argument("--json", type=Path, default=None)
    f.set_defaults(func=cmd)


def cmd(args) -> int:
    rows = [compare(p, args.tokens, args.llama_kv_f32) for p in args.model]
    for r in rows:
        o, t = r["ours"], r["llama.cpp"]
        print(f"{r['file']}: ours KL {o['kl_mean']:.2e} top1 {o['top1']:.3f} | llama.cpp KL {t['kl_mean']:.2e} "
              f"top1 {t['top1']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": platform.processor() or platform.machine(), "rows": rows}, indent=2))
    return 0
