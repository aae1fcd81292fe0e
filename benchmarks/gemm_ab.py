"""Two builds of the native kernels in one process, timed in alternation: the default build
(or one built with ``--on AMX_ALL``: every kind on the AMX tiles) against the same source built
with one setting turned off (``--off NO_AMX``: the wide 512-bit tiles instead of the AMX tiles;
``--off NO_AVX512``, ``--off NO_VNNI``).

On a shared VM the machine's speed drifts by tens of percent between runs a minute apart
(benchmarks/gemm_rate.py runs each build in its own process, one after the other). Here both
libraries are loaded side by side (ctypes, each its own symbols) and every round times one
product of each, so a drift hits both alike; the figure is the median over rounds of the
per-round ratio. Random matrices at the default model's FFN shapes (as gemm_rate.py), every
core the kernels use.

    .venv/bin/python benchmarks/gemm_ab.py [--on AMX_ALL] [--off NO_AMX] [--rows 16,32,128,512] [--rounds 15]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from compare import cpu_name  # benchmarks/compare.py (this folder is on sys.path when run as a script)
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from superfluid.runtimes.torch import kernels
from superfluid.runtimes.torch.qmat import QMat, c_struct

SHAPES = [(3072, 576), (576, 1536), (1536, 512)]  # 1536 x 512: K a multiple of 256 for the K-quants
TYPES = ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def library(off: str) -> ctypes.CDLL:
    """The kernels built with SUPERFLUID_KERNELS_<off>=1 (or as they are, off empty)."""
    env = f"SUPERFLUID_KERNELS_{off}" if off else None
    old = os.environ.get(env) if env else None
    try:
        if env:
            os.environ[env] = "1"
        lib = ctypes.CDLL(str(kernels._build()))
    finally:
        if env:
            os.environ.pop(env) if old is None else os.environ.__setitem__(env, old)
    kernels._bind(lib)
    lib.sf_set_threads(torch.get_num_threads())
    return lib


def matrix(name: str, N: int, K: int, rng) -> QMat | None:
    qtype = Q[name]
    block, size = GGML_QUANT_SIZES[qtype]
    if K % block:
        return None
    raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    for off in {Q.Q6_K: [208], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q4_1: [0, 2]}.get(qtype, [0]):
        raw[..., off:off + 2] = (rng.standard_normal((N, K // block, 1)) * .01).astype(np.float16).view(np.uint8)
    return QMat.from_gguf(raw.reshape(N, -1), qtype, K)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--on", default="", help="a setting the measured build turns on (AMX_ALL: every kind on the AMX tiles)")
    ap.add_argument("--off", default="NO_AMX", help="the setting the baseline build turns on (NO_AMX, NO_AVX512, NO_VNNI)")
    ap.add_argument("--rows", default="16,32,128,512")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    libs = {"default": library(a.on), a.off: library(a.off)}
    rng = np.random.default_rng(0)
    result: dict = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "build": a.on or "default", "baseline": a.off,
                    "amx": bool(libs["default"].sf_amx()), "gmac_s": {}, "ratio": {}}
    for name in TYPES:
        for N, K in SHAPES:
            m = matrix(name, N, K, rng)
            if m is None:
                continue
            c = ctypes.byref(c_struct(m))
            for M in rows:
                x, y = torch.randn(M, K), torch.empty(M, N)
                calls = max(1, int(1e7 / (N * K * M)))  # ~10 ms a timing at 1e9 MAC/s
                secs = {k: [] for k in libs}
                for r in range(a.rounds + 1):
                    for k, lib in libs.items():
                        time.sleep(0.005)  # the other library's pool stops spinning (kernels.c: SPIN_ROUNDS)
                        t = time.perf_counter()
                        for _ in range(calls):
                            lib.sf_gemv(c, x.data_ptr(), y.data_ptr(), M, 0)
                        if r:  # round 0 warms both (pages, threads)
                            secs[k].append((time.perf_counter() - t) / calls)
                key = f"{name} {N}x{K} M={M}"
                result["gmac_s"][key] = {k: N * K * M / statistics.median(v) / 1e9 for k, v in secs.items()}
                result["ratio"][key] = statistics.median(d / b for d, b in zip(secs[a.off], secs["default"]))
                g = result["gmac_s"][key]
                print(f"{key:24} default {g['default']:6.1f}  {a.off} {g[a.off]:6.1f} GMAC/s  ratio {result['ratio'][key]:.2f}x",
                      flush=True)
    path = Path(a.out or Path(__file__).with_name("results") / f"gemm_ab_{a.on.lower() + '_vs_' if a.on else ''}{a.off.lower()}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['cpu']}, {result['cores']} cores, amx {result['amx']}: wrote {path}")


if __name__ == "__main__":
    main()
