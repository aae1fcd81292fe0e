"""The native int8 GEMV/GEMM's rate (kernels.c) at decode and prefill row counts, against the
256-bit build and the wide (512-bit) build without AMX tiles, measured in the same run (the same-run
baselines, ``SUPERFLUID_KERNELS_NO_AVX512=1`` and ``SUPERFLUID_KERNELS_NO_AMX=1``).

For each GGUF type the kernels read as it is, a random matrix at a real shape (the default
model's FFN up/gate [3072, 576] and down [576, 1536]; with --shape 1b Llama-3.2-1B's [16384,
2048] and [2048, 8192]), x of M rows: median seconds a product over --repeats timings (each of enough products for ~20 ms), as GMAC/s (N K M
multiply-adds a second; a type whose block does not divide K is skipped) on every core the kernels use. Each build runs in its own process
(the library is built per setting and loaded once).

    .venv/bin/python benchmarks/gemm_rate.py [--rows 1,4,32,128,512] [--shape default|1b] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from compare import cpu_name  # benchmarks/compare.py (this folder is on sys.path when run as a script)

SHAPES = {"default": [(3072, 576), (576, 1536)], "1b": [(16384, 2048), (2048, 8192)]}
TYPES = ["Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def measure(shape: str, rows: list[int], repeats: int, threads: int) -> dict:
    """This process's build: {type: {"N x K": {M: GMAC/s}}}."""
    import numpy as np
    import torch

    if threads:
        torch.set_num_threads(threads)  # the kernels' pool follows torch's thread count
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

    from superfluid.runtimes.torch import kernels
    from superfluid.runtimes.torch.qmat import QMat

    out: dict = {}
    for name in TYPES:
        qtype = Q[name]
        block, size = GGML_QUANT_SIZES[qtype]
        for N, K in SHAPES[shape]:
            if K % block:
                continue  # K-quants need K a multiple of 256 (the default model's 576 is not)
            rng = np.random.default_rng(0)
            raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
            scale_at = {Q.Q6_K: [208], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q4_1: [0, 2]}.get(qtype, [0])
            for off in scale_at:  # finite fp16 scales (random bytes elsewhere: speed ignores values)
                raw[..., off:off + 2] = (rng.standard_normal((N, K // block, 1)) * .01).astype(np.float16).view(np.uint8)
            m = QMat.from_gguf(raw.reshape(N, -1), qtype, K)
            for M in rows:
                x = torch.randn(M, K)
                y = torch.empty(M, N)
                kernels.gemv(x, m, y)  # warm: build, pages, threads
                calls = max(1, int(2e7 / (N * K * M)))  # ~20 ms a repeat at 1e9 MAC/s: timer noise is small
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    for _ in range(calls):
                        kernels.gemv(x, m, y)
                    times.append((time.perf_counter() - t) / calls)
                out.setdefault(name, {}).setdefault(f"{N}x{K}", {})[M] = N * K * M / statistics.median(times) / 1e9
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,32,128,512")
    ap.add_argument("--shape", default="default", choices=sorted(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="threads (default: torch's, every core)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if a.worker:
        print(json.dumps(measure(a.shape, rows, a.repeats, a.threads)))
        return
    # the same-run baselines: the 256-bit tiles, and the wide (512-bit VNNI) tiles without AMX
    builds = {"256-bit": {"SUPERFLUID_KERNELS_NO_AVX512": "1", "SUPERFLUID_KERNELS_NO_AMX": "1"},
              "no-amx": {"SUPERFLUID_KERNELS_NO_AVX512": "", "SUPERFLUID_KERNELS_NO_AMX": "1"},
              "default": {"SUPERFLUID_KERNELS_NO_AVX512": "", "SUPERFLUID_KERNELS_NO_AMX": ""}}
    got = {}
    for build, env in builds.items():
        proc = subprocess.run([sys.executable, __file__, "--worker", "--rows", a.rows, "--shape", a.shape,
                               "--repeats", str(a.repeats), "--threads", str(a.threads)], env=dict(os.environ, **env), capture_output=True,
                              text=True, check=True)
        got[build] = json.loads(proc.stdout)
    result = {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": a.threads or None, "shape": a.shape, "rows": rows, "gmac_s": got,
              **{f"ratio_default_over_{b}": {t: {s: {m: got["default"][t][s][m] / got[b][t][s][m] for m in v}
                                                 for s, v in got[b][t].items()} for t in got[b]} for b in ("256-bit", "no-amx")}}
    path = Path(a.out or Path(__file__).with_name("results") / f"gemm_rate_{a.shape}{f'_t{a.threads}' if a.threads else ''}.json")
    path.write_text(json.dumps(result, indent=1))
    print(f"{result['cpu']}, {result['cores']} cores; GMAC/s default (no-amx, 256-bit), ratio over no-amx")
    for t, shapes in got["default"].items():
        for s, v in shapes.items():
            cells = "  ".join(f"M={m}: {v[m]:.1f} ({got['no-amx'][t][s][m]:.1f}, {got['256-bit'][t][s][m]:.1f}) "
                              f"{result['ratio_default_over_no-amx'][t][s][m]:.2f}x" for m in v)
            print(f"{t:5} {s:>10}  {cells}")


if __name__ == "__main__":
    main()
