"""Which quantized matrix each weight gets on the native route, and the route's name.

A ``Src`` is a weight matrix as the model builds it (fused, permuted, one expert of a
stack): its float rows, for the reference numerics and the fp32 GEMM, and per stacked part
the file's own blocks where the file stores them in a type a kernel reads as it is
(qmat.NATIVE). ``Src.qmat(quant)`` then gives:

- ``"gguf"`` (the default on a GGUF file, quant_choice.py): each part in its own blocks,
  repacked, never requantized; a part the file stores in a type with no kernel (F16, BF16,
  F32, Q2_K, Q3_K, IQ types) is quantized from its floats to the nearest kernel
  (NEAREST), and the route's name says so.
- ``"q8_0"`` | ``"q4_1"``: every matrix requantized from its floats (the explicit choice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as Q

from .qmat import NATIVE, QCat, QMat, stack

# A file's type -> the kernel its matrices run on: each type with a kernel to itself
# (qmat.NATIVE: Q4_0 and Q5_0 as q4_1 / q5_1 with min -8d / -16d, exactly); the rest
# requantized from their floats: 2-3 bits to q4_1 (finer than the file), anything wider
# (F16, BF16, F32, IQ types) to q8_0.
NEAREST = {Q.Q2_K: "q4_1", Q.Q3_K: "q4_1", **NATIVE}
FILE_ROUTE = "gguf"
# An embedding table over this many bytes in fp32 is gathered from the file's blocks on the
# file's route (QMat.rows; the loader then makes no float copy of it), a smaller one is held in
# floats. Measured (AMD EPYC Zen 4): gathering one token's row costs 61 us on the default
# model (1% of its 5 ms decode step; its float table is 113 MB) and 305 us on a 1B Q6_K
# table of 128k x 2048 (1% of 32 ms; its float table is 1 GB).
EMBED_FLOATS_MAX = 256 << 20


@dataclass(frozen=True)
class Part:
    rows: int
    qtype: Q | None  # None: floats of unknown origin (a Hugging Face folder, a test)
    raw: torch.Tensor | None  # uint8 [rows, row bytes] where qtype is in NATIVE


@dataclass(frozen=True)
class Src:
    w: torch.Tensor  # float [N, K] (or [E, N, K] for an expert stack)
    parts: tuple[Part, ...]

    @staticmethod
    def of(w: torch.Tensor, block: tuple[Q, torch.Tensor] | None = None) -> Src:
        """A file's tensor: its floats and, where load_gguf kept them, its blocks."""
        rows = w.shape[-2] if w.dim() == 3 else w.shape[0]
        return Src(w, (Part(rows, *block) if block else Part(rows, None, None),))

    def rows(self, fn) -> Src:
        """fn (a permutation of whole rows, e.g. within each head) applied to floats and blocks."""
        assert len(self.parts) == 1, "permute a tensor before stacking it"
        p = self.parts[0]
        return Src(fn(self.w), (Part(p.rows, p.qtype, fn(p.raw) if p.raw is not None else None),))

    def __getitem__(self, e: int) -> Src:
        """Expert e of a stack [E, N, K]."""
        p = self.parts[0]
        return Src(self.w[e], (Part(p.rows, p.qtype, p.raw[e] if p.raw is not None else None),))

    @staticmethod
    def cat(*srcs: Src) -> Src:
        """Stacked along N; neighbouring parts of one type merge (one kernel call part)."""
        parts: list[Part] = []
        for p in (p for s in srcs for p in s.parts):
            last = parts[-1] if parts else None
            if last and last.qtype == p.qtype and (last.raw is None) == (p.raw is None):
                raw = torch.cat([last.raw, p.raw]) if p.raw is not None else None
                parts[-1] = Part(last.rows + p.rows, p.qtype, raw)
            else:
                parts.append(p)
        return Src(torch.cat([s.w for s in srcs]), tuple(parts))

    def qmat(self, quant: str) -> QMat | QCat:
        if quant != FILE_ROUTE:
            return QMat(self.w, quant)
        out, row = [], 0
        for p in self.parts:
            if p.raw is not None and p.qtype in NATIVE:
                out.append(QMat.from_gguf(p.raw, p.qtype, self.w.shape[1]))
            else:
                origin = p.qtype.name if p.qtype is not None else None
                out.append(QMat(self.w[row: row + p.rows], NEAREST.get(p.qtype, "q8_0"), origin))
            row += p.rows
        return stack(out)


def route_label(mats) -> str:
    """The native route's name from its matrices (QMat/QCat), most common first: a file's
    type where its blocks are used as they are ("Q4_K"), "F16>q8_0" where requantized."""
    def name(p: QMat) -> str:
        if p.source is not None:
            return p.source.name
        return f"{p.origin}>{p.kind}" if p.origin else p.kind

    n = Counter(name(p) for m in mats for p in m.parts)
    return "+".join(k for k, _ in n.most_common())
