"""Which weights a torch runtime decodes on: the fast-by-default rule.

``quant`` is one of:
- ``"auto"`` (the default): a GGUF on CPU runs on the native kernel nearest to the file's
  own layer tensor types (NEAREST below); a Hugging Face folder, a CUDA device or a machine
  whose C compiler cannot build the kernels keep full precision.
- ``"none"``: the fp32 (or --dtype) reference numerics that match transformers.
- ``"q8_0"`` | ``"q4_1"``: that kernel, whatever the file holds.

On the quantized route the runtime is also batch- and path-invariant by default (every
product on the GEMV, every query on the native attention: each row computed from that row
alone), so a seeded request gives the same text alone, in any batch and with or without a
prefix-cache hit. ``invariant=False`` gives back the faster-but-route-dependent mix (fp32
GEMM for big products), for benchmarks.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as Q

CHOICES = ("auto", "none", "q8_0", "q4_1")

# The file's layer-matrix type -> the kernel that reproduces it best. 4-bit and smaller
# kinds read as q4_1 (Q4_1 exactly; Q4_0 exactly too, as q4_1 with min -8d; K-quants at
# 2-4 bits lose little more than they already lost); 5-bit and up, and float, as q8_0.
NEAREST = {
    Q.Q4_0: "q4_1", Q.Q4_1: "q4_1", Q.Q2_K: "q4_1", Q.Q3_K: "q4_1", Q.Q4_K: "q4_1",
    Q.Q5_0: "q8_0", Q.Q5_1: "q8_0", Q.Q5_K: "q8_0", Q.Q6_K: "q8_0", Q.Q8_0: "q8_0",
    Q.F16: "q8_0", Q.BF16: "q8_0", Q.F32: "q8_0",
}
_LAYER_MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def file_kind(reader) -> Q | None:
    """The most common type among a GGUF's layer matrices (None: the file has none)."""
    kinds = Counter(Q(t.tensor_type) for t in reader.tensors
                    if t.name.startswith("blk.") and t.name.split(".")[2] in _LAYER_MATRICES)
    return kinds.most_common(1)[0][0] if kinds else None


def resolve_quant(quant: str | None, path: Path, device: torch.device, reader=None) -> str | None:
    """The kernel to decode on (None: full precision). Raises ValueError for an unknown name."""
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
    if reader is None:
        from .gguf_weights import open_gguf

        reader = open_gguf(path)
    kind = file_kind(reader)
    return NEAREST.get(kind, "q8_0") if kind is not None else None
