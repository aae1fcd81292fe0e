"""Quantized weight matrices in the native kernel's layout (kernels.c, "interleaved tiles").

A ``QMat`` is one matrix [N, K] in one kind. It is built either from a GGUF file's own
blocks (``QMat.from_gguf``: the file's integers and scales repacked, never requantized) or
from floats (``QMat(w, kind)``, q8_0 / q4_1: the explicit ``--quant`` choices and the
tensors a file stores in a type with no kernel). A ``QCat`` stacks matrices of any kinds
along N (a fused qkv whose v a Q4_K_M file keeps in Q6_K).

Kinds, and the GGUF types each reads as it is (w: the weight the kernel multiplies by):
- q8_0 (Q8_0): w = d q, q int8, d fp16 per 32.
- q4_1 (Q4_1, and Q4_0 as min -8d, exact in fp16): w = d q + m, q 0..15, d, m fp16 per 32.
- q5_1 (Q5_1, and Q5_0 as min -16d): as q4_1 with q 0..31.
- q4_k (Q4_K), q5_k (Q5_K): w = (d sc) q - (dmin mn), q 0..15 / 0..31, sc, mn 6-bit per 32,
  d, dmin fp16 per 256.
- q6_k (Q6_K): w = (d sc) (q - 32), q 0..63, sc int8 per 16, d fp16 per 256.

Storage (rows in groups of R = 8, N padded with zero rows; per group and block of 32):
``q`` the low 4 bits as q4_1's nibble plane (q8_0: int8 values), ``qh`` the high bits
(5-bit: one bit plane, q6_k: two), scales interleaved lane by row. kernels.c's comment gives
the byte order; ``dequantize`` undoes it, so a test can check a file's blocks survive.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

QK = 32  # quantization block along the reduction dimension
R = 8  # rows per interleaved group
KINDS = ("q8_0", "q4_1", "q5_1", "q4_k", "q5_k", "q6_k")  # kernels.c's enum order
HIGH_BITS = {"q5_1": 1, "q5_k": 1, "q6_k": 2}
K_KINDS = ("q4_k", "q5_k", "q6_k")  # scales per 256
FLOAT_KINDS = ("q8_0", "q4_1")  # what QMat(w, kind) quantizes floats to
# GGUF type -> the kind that holds its blocks exactly
NATIVE = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_1", Q.Q4_1: "q4_1", Q.Q5_0: "q5_1", Q.Q5_1: "q5_1",
          Q.Q4_K: "q4_k", Q.Q5_K: "q5_k", Q.Q6_K: "q6_k"}


class QMat:
    """One matrix [N, K] in one kind (module doc). ``source``: the GGUF type whose blocks it
    holds, or None when it was quantized from floats; ``origin``: for those, what the floats
    were (a GGUF type's name, for the route's name), if known."""

    __slots__ = ("kind", "q", "qh", "d", "m", "sc", "mn", "N", "K", "source", "origin", "_c")

    def __init__(self, w: torch.Tensor | None, kind: str, origin: str | None = None):
        self.q = self.qh = self.m = self.sc = self.mn = self._c = None
        self.source, self.origin = None, origin
        if w is None:  # from_gguf fills the fields
            self.kind = kind
            return
        if w.dim() != 2 or w.shape[1] % QK:
            raise ValueError(f"cannot quantize a {list(w.shape)} matrix in blocks of {QK}")
        if kind not in FLOAT_KINDS:
            raise ValueError(f"unknown quantization {kind!r}; one of {', '.join(FLOAT_KINDS)}")
        self.kind, (self.N, self.K) = kind, w.shape
        blocks = w.detach().to(torch.float32).reshape(self.N, self.K // QK, QK)
        if kind == "q8_0":
            d = (blocks.abs().amax(-1) / 127).half().float()  # the scale as stored (fp16, as GGUF)
            q = torch.where(d[..., None] > 0, blocks / d.clamp_min(1e-30)[..., None], torch.zeros_like(blocks))
            self._pack(q.round().clamp(-127, 127).to(torch.int8), d)
        else:
            lo = blocks.amin(-1).half().float()  # scales as stored (fp16, as GGUF)
            d = ((blocks.amax(-1) - lo) / 15).half().float()
            q = torch.where(d[..., None] > 0, (blocks - lo[..., None]) / d.clamp_min(1e-30)[..., None],
                            torch.zeros_like(blocks)).round().clamp(0, 15).to(torch.uint8)
            self._pack(q, d, lo)

    @classmethod
    def from_gguf(cls, raw: np.ndarray | torch.Tensor, qtype: Q, K: int) -> QMat:
        """A GGUF tensor's blocks, raw uint8 [N, row bytes] (rows in any order the caller
        chose: a permutation of whole rows keeps the blocks), in the kind NATIVE[qtype]."""
        kind = NATIVE.get(Q(qtype))
        if kind is None:
            raise ValueError(f"no kernel reads {Q(qtype).name} blocks as they are")
        raw = np.ascontiguousarray(raw.numpy() if isinstance(raw, torch.Tensor) else raw, dtype=np.uint8)
        if raw.ndim != 2 or K % QK or (kind in K_KINDS and K % 256):
            raise ValueError(f"{Q(qtype).name}: cannot read rows of {K} values from {list(raw.shape)} bytes")
        m = cls(None, kind)
        m.N, m.K, m.source = raw.shape[0], K, Q(qtype)
        m._pack(*_decode(raw, Q(qtype), K))
        return m

    def _pack(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None,
              sc: torch.Tensor | None = None, mn: torch.Tensor | None = None) -> None:
        """q [N, nb, 32] values (int8 for q8_0, else unsigned), d [N, nb or nb / 8] fp16-exact
        floats, m the same shape (min or dmin), sc [N, nb] (q6_k: [N, nb, 2]), mn [N, nb]."""
        N, nb = self.N, self.K // QK
        Np = -(-N // R) * R
        G = Np // R

        def rows(t: torch.Tensor) -> torch.Tensor:  # pad to Np rows, as [G, R, ...]
            out = t.new_zeros((Np, *t.shape[1:]))
            out[:N] = t
            return out.view(G, R, *t.shape[1:])

        def lanes(t: torch.Tensor) -> torch.Tensor:  # [N, n(, 2)] -> [G, n(, 2), R]: lane i for row 8g + i
            t = rows(t)
            return t.permute(0, 2, 1).contiguous() if t.dim() == 3 else t.permute(0, 2, 3, 1).contiguous()

        q = rows(q)  # [G, R, nb, 32]
        if self.kind == "q8_0":
            self.q = q.view(G, R, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
        else:
            u = q.to(torch.uint8)
            plane = (u[..., :16] & 15) | ((u[..., 16:] & 15) << 4)  # [G, R, nb, 16]: value j low, j + 16 high
            self.q = plane.view(G, R, nb, 4, 4).permute(0, 2, 3, 1, 4).contiguous()
            bits = HIGH_BITS.get(self.kind)
            if bits:
                h = (u >> 4).view(G, R, nb, 2, 4, 4).to(torch.int32)  # [.., up, chunk j, t]
                if bits == 1:  # byte t: bit j of the low values' chunk j, bit 4 + j of the high ones'
                    shift = (torch.arange(2)[:, None] * 4 + torch.arange(4)[None, :]).view(1, 1, 1, 2, 4, 1)
                    hb = (h << shift).sum((3, 4))  # [G, R, nb, 4]
                    self.qh = hb.to(torch.uint8).permute(0, 2, 1, 3).contiguous()  # [G, nb, R, 4]
                else:  # half j // 2, bits 4 (j % 2) + 2 up
                    h = h.view(G, R, nb, 2, 2, 2, 4)  # [.., up, half, c, t]
                    shift = (torch.arange(2)[:, None] * 2 + torch.arange(2)[None, :] * 4).view(1, 1, 1, 2, 1, 2, 1)
                    hb = (h << shift).sum((3, 5))  # [G, R, nb, half, 4]
                    self.qh = hb.to(torch.uint8).permute(0, 2, 3, 1, 4).contiguous()  # [G, nb, half, R, 4]
        self.d = lanes(d.float()).half()
        self.m = lanes(m.float()).half() if m is not None else None
        if sc is not None:
            self.sc = lanes(sc.to(torch.int8 if self.kind == "q6_k" else torch.uint8))
            self.mn = lanes(mn.to(torch.uint8)) if mn is not None else None

    def values(self) -> torch.Tensor:
        """The stored integers [N, K] (q8_0 signed, else unsigned), read back from the planes."""
        G, nb = self.q.shape[:2]
        if self.kind == "q8_0":
            return self.q.permute(0, 3, 1, 2, 4).reshape(G * R, self.K)[: self.N]
        plane = self.q.permute(0, 3, 1, 2, 4).reshape(G * R, nb, 16).to(torch.int32)
        v = torch.cat([plane & 15, plane >> 4], dim=-1)  # [Np, nb, 32]
        bits = HIGH_BITS.get(self.kind)
        if bits == 1:
            hb = self.qh.permute(0, 2, 1, 3).reshape(G * R, nb, 1, 1, 4).to(torch.int32)
            shift = (torch.arange(2)[:, None] * 4 + torch.arange(4)[None, :]).view(1, 1, 2, 4, 1)
            v = v | (((hb >> shift) & 1) << 4).reshape(G * R, nb, 32)
        elif bits == 2:
            hb = self.qh.permute(0, 3, 1, 2, 4).reshape(G * R, nb, 1, 2, 1, 4).to(torch.int32)  # [.., half, t]
            shift = (torch.arange(2)[:, None] * 2 + torch.arange(2)[None, :] * 4).view(1, 1, 2, 1, 2, 1)
            v = v | (((hb >> shift) & 3) << 4).reshape(G * R, nb, 32)
        return v.reshape(G * R, self.K)[: self.N]

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] matrix the kernel multiplies by (a GGUF file's blocks: exactly
        ``gguf.quants.dequantize`` of them)."""
        N, nb = self.N, self.K // QK

        def rows(t: torch.Tensor) -> torch.Tensor:  # interleaved [G, n(, 2), R] -> [N, n(, 2)]
            t = t.float()
            t = t.permute(0, 2, 1) if t.dim() == 3 else t.permute(0, 3, 1, 2)
            return t.reshape(-1, *t.shape[2:])[:N]

        v = self.values().float().view(N, nb, QK)
        d = rows(self.d)
        if self.kind in K_KINDS:
            d = d.repeat_interleave(8, dim=1)  # per 256 -> per 32
            if self.kind == "q6_k":
                scale = (d[..., None] * rows(self.sc)).repeat_interleave(16, dim=-1)  # [N, nb, 32]
                return (scale * (v - 32)).view(N, self.K)
            dm = rows(self.m).repeat_interleave(8, dim=1)
            return ((d * rows(self.sc))[..., None] * v - (dm * rows(self.mn))[..., None]).view(N, self.K)
        w = v * d[..., None]
        if self.m is not None:
            w = w + rows(self.m)[..., None]
        return w.view(N, self.K)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows idx [T] of dequantize() (the same floats), reading only their groups: an
        embedding gather from the table's blocks instead of a float copy of the table."""
        groups, where = torch.unique(idx // R, return_inverse=True)
        sub = QMat(None, self.kind)
        sub.N, sub.K = groups.numel() * R, self.K
        for f in ("q", "qh", "d", "m", "sc", "mn"):
            t = getattr(self, f)
            setattr(sub, f, t.index_select(0, groups) if t is not None else None)
        return sub.dequantize().index_select(0, where * R + idx % R)

    @property
    def parts(self) -> tuple[QMat, ...]:
        return (self,)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.qh, self.d, self.m, self.sc, self.mn)
                   if t is not None)


class QCat:
    """QMats over the same K stacked along N (at most kernels.c's MAX_PARTS)."""

    __slots__ = ("parts", "N", "K", "_c")
    MAX_PARTS = 4

    def __init__(self, parts: list[QMat]):
        if not 1 <= len(parts) <= self.MAX_PARTS or len({p.K for p in parts}) != 1:
            raise ValueError(f"cannot stack {len(parts)} matrices of K {sorted({p.K for p in parts})}")
        self.parts, self.N, self.K, self._c = tuple(parts), sum(p.N for p in parts), parts[0].K, None

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def stack(parts: list[QMat]) -> QMat | QCat:
    return parts[0] if len(parts) == 1 else QCat(parts)


def kinds(m: QMat | QCat) -> tuple[str, ...]:
    return tuple(p.kind for p in m.parts)


# ------------------------------------------------------------------ the C structs


class QMatC(ctypes.Structure):  # kernels.c's sf_qmat (field order and types must match)
    _fields_ = [("kind", ctypes.c_int), ("q", ctypes.c_void_p), ("qh", ctypes.c_void_p), ("d", ctypes.c_void_p),
                ("m", ctypes.c_void_p), ("sc", ctypes.c_void_p), ("mn", ctypes.c_void_p),
                ("N", ctypes.c_int), ("K", ctypes.c_int)]


class QCatC(ctypes.Structure):  # sf_qcat
    _fields_ = [("p", QMatC * QCat.MAX_PARTS), ("n", ctypes.c_int)]


def c_struct(m: QMat | QCat) -> QCatC:
    """The sf_qcat kernels.c reads, built once per matrix (it points into m's tensors, which
    m keeps alive)."""
    if m._c is None:
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        c = QCatC()
        for i, p in enumerate(m.parts):
            c.p[i] = QMatC(KINDS.index(p.kind), ptr(p.q), ptr(p.qh), ptr(p.d), ptr(p.m), ptr(p.sc), ptr(p.mn),
                           p.N, p.K)
        c.n = len(m.parts)
        m._c = c
    return m._c


# ------------------------------------------------------------- GGUF blocks, decoded


def _f16(b: np.ndarray) -> torch.Tensor:
    """[..., 2] uint8 -> float32 of the fp16 they hold."""
    return torch.from_numpy(np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1/Q5_x's 16 bytes per block -> 32 values: byte j's low nibble is value j, its high j + 16."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes per 256 -> (sc, mn) [.., 8] 6-bit (llama.cpp's get_scale_min_k4)."""
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _decode(raw: np.ndarray, qtype: Q, K: int):
    """(q [N, nb, 32], d, m, sc, mn) as QMat._pack takes them, from raw blocks [N, row bytes]."""
    N, nb = raw.shape[0], K // QK
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))  # noqa: E731
    if qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        size = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20, Q.Q5_0: 22, Q.Q5_1: 24}[qtype]
        b = raw.reshape(N, nb, size)
        d = _f16(b[..., 0:2])
        if qtype == Q.Q8_0:
            return t(b[..., 2:].view(np.int8)), d
        mins = qtype in (Q.Q4_1, Q.Q5_1)
        m = _f16(b[..., 2:4]) if mins else None
        off = 4 if mins else 2
        if qtype in (Q.Q4_0, Q.Q4_1):
            q = _nibbles(b[..., off:off + 16])
        else:
            qh = b[..., off:off + 4].copy().view("<u4")  # [N, nb, 1]: bit j is value j's bit 4
            q = _nibbles(b[..., off + 4:off + 20]) | (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        if m is None:  # Q4_0: w = d (q - 8) = d q - 8 d; Q5_0: d (q - 16). Exact in fp16 (a power of two).
            m = (d * -(8 if qtype == Q.Q4_0 else 16)).half().float()
        return t(q), d, m
    n = K // 256
    if qtype in (Q.Q4_K, Q.Q5_K):
        size = 144 if qtype == Q.Q4_K else 176
        b = raw.reshape(N, n, size)
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
        sc, mn = _k_scales(b[..., 4:16])
        qs = b[..., -128:].reshape(N, n, 4, 32)  # 64 values per 32 bytes: low nibbles then high
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(N, n, 8, 32)  # [.., sub-block, 32]
        if qtype == Q.Q5_K:  # qh byte l, bit 2c (low) / 2c + 1 (high): bit 4 of value l of sub-blocks 2c, 2c + 1
            qh = b[..., 16:48]
            bit = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1
            q = q | (bit << 4)
        return t(q.reshape(N, nb, 32)), d, dmin, t(sc.reshape(N, nb)), t(mn.reshape(N, nb))
    if qtype == Q.Q6_K:
        b = raw.reshape(N, n, 210)
        ql, qh, sc, d = b[..., :128], b[..., 128:192], b[..., 192:208].view(np.int8), b[..., 208:210]
        ql, qh = ql.reshape(N, n, 2, 64), qh.reshape(N, n, 2, 1, 32)  # two halves of 128 values
        low = np.stack([ql & 15, ql >> 4], axis=3).reshape(N, n, 2, 4, 32)  # value 32 k + l of each half
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
        q = (low | (high << 4)).reshape(N, nb, 32)
        return t(q), _f16(d), None, t(sc.reshape(N, nb, 2))
    raise ValueError(f"no kernel reads {qtype.name} blocks as they are")
