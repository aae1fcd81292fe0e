"""Which weights a torch runtime decodes on: the fast-by-default rule.

``quant`` is one of:
- ``"auto"`` (the default): ``"gguf"`` for a GGUF on CPU; a Hugging Face folder, a CUDA
  device or a machine whose C compiler cannot build the kernels keep full precision.
- ``"gguf"``: every matrix on the native kernel for the file's own blocks, never
  requantized (quantized.py; types with no kernel, F16 or Q3_K, go to the nearest one).
- ``"none"``: the fp32 (or --dtype) reference numerics that match transformers.
- ``"q8_0"`` | ``"q4_1"``: every matrix requantized to that kernel, whatever the file holds.

On the quantized route the runtime is also batch- and path-invariant by default (every
product on the GEMV, every query on the native attention: each row computed from that row
alone), so a seeded request gives the same text alone, in any batch and with or without a
prefix-cache hit. ``invariant=False`` gives back the faster-but-route-dependent mix (fp32
GEMM for big products), for benchmarks.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .quantized import FILE_ROUTE

CHOICES = ("auto", "gguf", "none", "q8_0", "q4_1")


def resolve_quant(quant: str | None, path: Path, device: torch.device) -> str | None:
    """The route to decode on: "gguf", "q8_0", "q4_1" or None (full precision). Raises
    ValueError for an unknown name. Which kernel each of a file's types runs on:
    quantized.NEAREST."""
    quant = "auto" if quant is None else quant
    if quant not in CHOICES:
        raise ValueError(f"unknown quant {quant!r}; one of {', '.join(CHOICES)}")
    if quant != "auto":
        return None if quant == "none" else quant
    if device.type != "cpu" or path.suffix != ".gguf":
        return None  # CUDA and HF folders keep their own precision
    from . import kernels

    if kernels.native() is None:
        return None  # no compiler here: the reference path still runs
    return FILE_ROUTE
