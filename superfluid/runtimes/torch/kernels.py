"""Native CPU kernels (kernels.c): built once per machine with the system C compiler, loaded
with ctypes, cached under $SUPERFLUID_CACHE (default ~/.cache/superfluid).

``native()`` is None when no compiler or no build is possible; callers keep the torch path
then. Every entry point works on contiguous fp32 CPU tensors and checks what it is given:
a wrong shape or dtype is a ValueError here, never a read past a buffer in C.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .qmat import QK, QCat, QCatC, QMat, c_struct, kinds  # noqa: F401  QMat, QCat re-exported (kernels.QMat)

SOURCE = Path(__file__).with_name("kernels.c")
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_threads = 0


def cache_dir() -> Path:
    return Path(os.environ.get("SUPERFLUID_CACHE") or Path.home() / ".cache" / "superfluid")


def _cpu_key() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
        flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def _build() -> Path:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    src = SOURCE.read_bytes()
    portable = bool(os.environ.get("SUPERFLUID_PORTABLE_KERNELS"))  # tests: the plain C paths
    no_vnni = bool(os.environ.get("SUPERFLUID_KERNELS_NO_VNNI"))  # tests, benchmarks: AVX2 dot products on a VNNI CPU
    no_512 = bool(os.environ.get("SUPERFLUID_KERNELS_NO_AVX512"))  # tests, benchmarks: 256-bit attention
    no_amx = bool(os.environ.get("SUPERFLUID_KERNELS_NO_AMX"))  # tests, benchmarks: the wide tiles on an AMX CPU
    amx_all = bool(os.environ.get("SUPERFLUID_KERNELS_AMX_ALL"))  # tests, benchmarks: every kind on the AMX tiles
    key = hashlib.sha256(src + _cpu_key().encode() + cc.encode() + bytes([portable, no_vnni, no_512, no_amx, amx_all])).hexdigest()[:16]
    out = cache_dir() / f"kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    base = ["-O3", "-fPIC", "-shared", "-pthread", "-std=c11", "-D_GNU_SOURCE"] + (["-DSF_NO_VNNI"] if no_vnni else [])
    base += ["-DSF_NO_AVX512"] if no_512 else []
    base += ["-DSF_NO_AMX"] if no_amx else []
    base += ["-DSF_AMX_ALL_KINDS"] if amx_all else []
    errors = []
    for arch in ([] if portable else ["-march=native"], []):  # native ISA (AVX2/FMA) first; portable C otherwise
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        proc = subprocess.run([cc, *base, *arch, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode == 0:
            os.replace(tmp, out)  # atomic: concurrent builders leave one good file
            return out
        os.unlink(tmp)
        errors.append(proc.stderr.strip()[-2000:])
    raise RuntimeError("building kernels.c failed: " + " | ".join(errors))


def _bind(lib: ctypes.CDLL) -> None:
    P, I, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.sf_set_threads.argtypes, lib.sf_set_threads.restype = [I], I
    lib.sf_gemv.argtypes, lib.sf_gemv.restype = [P, P, P, I, I], I
    lib.sf_amx.argtypes, lib.sf_amx.restype = [], I
    lib.sf_attend_decode.argtypes = [P, P, P, P, P, P, I, I, I, I, I, F, P]
    lib.sf_attend_decode.restype = I
    lib.sf_rms_norm.argtypes, lib.sf_rms_norm.restype = [P, P, P, I, I, F], None
    lib.sf_rope_kv.argtypes, lib.sf_rope_kv.restype = [P, I, I, I, I, P, P, P, P, P, P, P], None
    lib.sf_silu_mul.argtypes, lib.sf_silu_mul.restype = [P, I, I, P], None
    lib.sf_experts.argtypes, lib.sf_experts.restype = [P, P, I, I, P], I
    lib.sf_decode.argtypes, lib.sf_decode.restype = [P, P, I, P, P, P, I, P, P, P], I


def native() -> ctypes.CDLL | None:
    """The loaded library, building it on first use; None (see ``native_error()``) if impossible."""
    global _lib, _error
    if _lib is not None:  # the hot path: no lock once loaded
        _sync_threads(_lib)
        return _lib
    with _lock:
        if _lib is None and _error is None:
            if os.environ.get("SUPERFLUID_NO_NATIVE"):
                _error = "disabled by SUPERFLUID_NO_NATIVE"
                return None
            try:
                lib = ctypes.CDLL(str(_build()))
                _bind(lib)
                _lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _error = str(e)
        if _lib is not None:
            _sync_threads(_lib)
        return _lib


def native_error() -> str | None:
    return _error


def amx() -> bool:
    """Whether many-row products (>= 16 x rows; q8_0 matrices, every kind with
    SUPERFLUID_KERNELS_AMX_ALL) run on the CPU's AMX tiles: the build has them (an AMX-INT8 CPU,
    SUPERFLUID_KERNELS_NO_AMX unset) and the OS granted the tile state."""
    lib = native()
    return bool(lib is not None and lib.sf_amx())


def _sync_threads(lib: ctypes.CDLL) -> None:
    global _threads
    n = torch.get_num_threads()
    if n != _threads:
        _threads = lib.sf_set_threads(n)


def _check(rc: int, what: str, bad_args: str = "bad arguments") -> None:
    """A kernel's return code as an exception: -1 bad arguments (checked before anything is
    written), -2 an allocation failed (MemoryError: the step fails, its output is never used)."""
    if rc == -2:
        raise MemoryError(f"{what}: the native kernel could not allocate its scratch memory")
    if rc:
        raise ValueError(f"{what}: {bad_args} ({rc})")


def _f32(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{name}: contiguous float32 CPU tensor expected, got {t.dtype} on {t.device}")


# ----------------------------------------------------------------- quantized matrices
# QMat / QCat (qmat.py): the weights in the tiles' layout, from a GGUF file's blocks or floats.


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel does to x before the integer products (for tests): per block of 32,
    int8 with scale amax / 127, rounded half to even."""
    b = x.float().view(*x.shape[:-1], -1, QK)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.where(amax > 0, (b * (127 / amax.clamp_min(1e-30))).round(), torch.zeros_like(b))
    return (q * (amax / 127)).view(x.shape)


def gemv(x: torch.Tensor, m: QMat | QCat, out: torch.Tensor | None = None, accumulate: bool = False) -> torch.Tensor:
    """x [M, K] float32 -> [M, N] float32 (out += x W^T when accumulate)."""
    lib = native()
    if lib is None:
        raise RuntimeError(f"native kernels unavailable: {native_error()}")
    _f32(x, "x")
    if x.dim() != 2 or x.shape[1] != m.K:
        raise ValueError(f"x has shape {list(x.shape)}, expected [M, {m.K}]")
    M = x.shape[0]
    if out is None:
        if accumulate:
            raise ValueError("accumulate needs out")
        out = torch.empty(M, m.N, dtype=torch.float32)
    else:
        _f32(out, "out")
        if tuple(out.shape) != (M, m.N):
            raise ValueError(f"out has shape {list(out.shape)}, expected [{M}, {m.N}]")
    rc = lib.sf_gemv(ctypes.byref(c_struct(m)), x.data_ptr(), out.data_ptr(), M, int(accumulate))
    _check(rc, f"sf_gemv ({'+'.join(kinds(m))})")
    return out


def attend_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, gather: torch.Tensor, first: torch.Tensor,
                  lens: torch.Tensor, check_cells: bool = True) -> torch.Tensor:
    """One query per sequence. q [B, H, d]; kc, vc [S, Hkv, d]; gather [B, L] int64 cells;
    row b attends to its entries first[b] .. lens[b] - 1. -> [B, H, d] float32.
    ``check_cells=False`` skips the range check of gather (a caller that checked it once per step)."""
    lib = native()
    for t, n in ((q, "q"), (kc, "kc"), (vc, "vc")):
        _f32(t, n)
    B, H, d = q.shape
    S, Hkv, dk = kc.shape
    if dk != d or vc.shape != kc.shape or H % Hkv:
        raise ValueError("attend_decode: q, kc and vc shapes disagree")
    for t in (gather, first, lens):
        if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("attend_decode: gather, first and lens: contiguous int64 CPU tensors expected")
    if gather.dim() != 2 or gather.shape[0] != B or tuple(lens.shape) != (B,) or tuple(first.shape) != (B,):
        raise ValueError("attend_decode: gather [B, L], first [B] and lens [B] expected")
    L = gather.shape[1]
    if check_cells and B and (int(gather.min()) < 0 or int(gather.max()) >= S):
        raise ValueError("attend_decode: cell index out of range")
    out = torch.empty_like(q)
    rc = lib.sf_attend_decode(q.data_ptr(), kc.data_ptr(), vc.data_ptr(), gather.data_ptr(), first.data_ptr(),
                              lens.data_ptr(), B, H, Hkv, d, L, d ** -0.5, out.data_ptr())
    _check(rc, "attend_decode", "need 0 <= first < lens <= L for every row")
    return out


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    lib = native()
    _f32(x, "x")
    _f32(w, "w")
    if x.dim() != 2 or x.shape[1] != w.shape[0]:
        raise ValueError("rms_norm: x [M, D] and w [D] expected")
    out = torch.empty_like(x)
    lib.sf_rms_norm(x.data_ptr(), w.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            kc: torch.Tensor, vc: torch.Tensor, n_heads: int) -> torch.Tensor:
    """RoPE on the q and k heads of qkv [T, (H + 2 Hkv) d]; k and v stored at cells ``slots``
    of kc, vc [S, Hkv, d]; returns q [T, H, d]. positions index the cos/sin tables [P, d].
    The caller owns the ranges: positions < P and slots < S (the runtime checks both per step)."""
    lib = native()
    for t, n in ((qkv, "qkv"), (cos, "cos"), (sin, "sin"), (kc, "kc"), (vc, "vc")):
        _f32(t, n)
    T = qkv.shape[0]
    S, Hkv, d = kc.shape
    if qkv.shape[1] != (n_heads + 2 * Hkv) * d or cos.shape[1] != d or positions.shape != (T,) \
            or slots.shape != (T,) or positions.dtype != torch.int64 or slots.dtype != torch.int64 \
            or not positions.is_contiguous() or not slots.is_contiguous():
        raise ValueError("rope_kv: shapes disagree")
    q = torch.empty(T, n_heads, d)
    lib.sf_rope_kv(qkv.data_ptr(), T, n_heads, Hkv, d, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
                   slots.data_ptr(), kc.data_ptr(), vc.data_ptr(), q.data_ptr())
    return q


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """gu [T, 2F] (gate, up) -> silu(gate) * up [T, F]."""
    lib = native()
    _f32(gu, "gu")
    T, F2 = gu.shape
    out = torch.empty(T, F2 // 2)
    lib.sf_silu_mul(gu.data_ptr(), T, F2 // 2, out.data_ptr())
    return out


# ------------------------------------------------------------ mixture of experts


class _MoeC(ctypes.Structure):  # kernels.c's sf_moe
    _fields_ = [("E", ctypes.c_int), ("used", ctypes.c_int), ("renorm", ctypes.c_int), ("F", ctypes.c_int),
                ("router", QCatC), ("gu", ctypes.POINTER(QCatC)), ("down", ctypes.POINTER(QCatC))]


def experts_runnable(E) -> bool:
    """Whether sf_experts runs decoder.Experts E: every matrix quantized (the router too)."""
    return all(m.q is not None for m in [E.router] + E.wgu + E.wdown)


def moe_struct(E) -> _MoeC:
    """The sf_moe of decoder.Experts E (experts_runnable), built once and kept on E (it
    points into the matrices' tensors, which E keeps alive)."""
    if E.native is None:
        n = len(E.wgu)
        gu, down = (QCatC * n)(*[c_struct(m.q) for m in E.wgu]), (QCatC * n)(*[c_struct(m.q) for m in E.wdown])
        c = _MoeC(n, E.used, int(E.renormalise), E.wdown[0].q.K, c_struct(E.router.q),
                  ctypes.cast(gu, ctypes.POINTER(QCatC)), ctypes.cast(down, ctypes.POINTER(QCatC)))
        E.native = (c, gu, down)
    return E.native[0]


def experts(h: torch.Tensor, E) -> torch.Tensor:
    """The mixture-of-experts feed-forward of h [T, D] (before the residual add), on the
    quantized GEMV: decoder._experts's routing and sums, in C."""
    lib = native()
    _f32(h, "h")
    T, D = h.shape
    out = torch.empty(T, D)
    _check(lib.sf_experts(ctypes.byref(moe_struct(E)), h.data_ptr(), T, D, out.data_ptr()), "sf_experts")
    return out


# ------------------------------------------------------------ whole decode forward
# Mirrors of kernels.c's sf_qmat / sf_layer / sf_model (field order and types must match).


class _LayerC(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p), ("bqkv", ctypes.c_void_p),
                ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("wqkv", QCatC), ("wo", QCatC), ("wgu", QCatC), ("wdown", QCatC), ("moe", ctypes.POINTER(_MoeC)),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p)]


class _ModelC(ctypes.Structure):
    _fields_ = [("n_layers", ctypes.c_int), ("D", ctypes.c_int), ("F", ctypes.c_int),
                ("H", ctypes.c_int), ("Hkv", ctypes.c_int), ("d", ctypes.c_int), ("qk_norm", ctypes.c_int),
                ("eps", ctypes.c_float),
                ("scale", ctypes.c_float), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("norm", ctypes.c_void_p), ("layers", ctypes.POINTER(_LayerC))]


# What sf_decode computes beyond a plain Llama layer: q/k/v biases (added after the qkv
# product), a sliding window (each row's key span first .. lens - 1), RoPE scaling (linear,
# llama3, YaRN: all in the cos/sin tables, YaRN's attention factor included, built in Python),
# q/k norms (per head or over all heads: Qwen3, OLMoE) and mixture-of-experts feed-forwards
# (sf_experts: Qwen3-MoE, OLMoE, Mixtral).
DECODER_FEATURES = frozenset({"attention_bias", "sliding_window", "rope_scaling", "qk_norm", "n_experts",
                              "n_experts_used", "moe_norm_topk"})
# ModelConfig fields that are shapes and constants sf_model carries, or that act outside the layers.
# embed_scale, logit_scale and final_softcap act on the embeddings and logits, outside sf_decode.
_PLAIN_FIELDS = frozenset({"arch", "vocab_size", "hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads",
                           "head_dim", "rope_theta", "rms_eps", "max_position", "tie_embeddings", "embed_scale",
                           "logit_scale", "final_softcap"})


def decoder_refusal(model, kv_k: torch.Tensor, kv_v: torch.Tensor) -> str | None:
    """Why sf_decode cannot run this model over this pool, or None. It implements the
    features in DECODER_FEATURES (any other ModelConfig field set on a model is refused, so
    a feature added to the config falls back to the op-by-op route until sf_decode learns
    it), every layer matrix quantized (each in its own kinds), fp32 CPU tensors."""
    cfg = model.cfg
    unknown = sorted(f.name for f in dataclasses.fields(cfg) if f.name not in _PLAIN_FIELDS | DECODER_FEATURES
                     and getattr(cfg, f.name) != f.default)  # an option off is its default
    if unknown:
        return f"sf_decode does not implement {', '.join(unknown)}"
    mats = [m for L in model.layers for m in (L.wqkv, L.wo, L.wgu, L.wdown) if m is not None]
    if any(m.q is None for m in mats) or any(not experts_runnable(L.experts) for L in model.layers if L.experts):
        return "sf_decode runs quantized layer matrices only"
    if cfg.activation != "silu" and cfg.n_experts:
        return "sf_experts gates with SiLU only"
    tensors = [model.cos, model.sin, model.norm, kv_k, kv_v] + [t for L in model.layers for t in
                                                                (L.attn_norm, L.ffn_norm, L.bqkv, L.q_norm, L.k_norm)
                                                                if t is not None]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return "sf_decode reads contiguous float32 CPU tensors"
    return None


class Decoder:
    """The model's weights and one KV pool as the C structs sf_decode reads (build it only
    where ``decoder_refusal`` is None). It holds the tensors it points at; the pool's k/v
    tensors must not be reallocated while it lives (native.whole_step keys it by the pool)."""

    def __init__(self, model, kv_k: torch.Tensor, kv_v: torch.Tensor):
        refused = decoder_refusal(model, kv_k, kv_v)
        if refused:
            raise ValueError(refused)
        cfg = model.cfg
        tensors = [model.cos, model.sin, model.norm, kv_k, kv_v]
        layers = (_LayerC * cfg.n_layers)()
        ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
        dense = lambda m: c_struct(m.q) if m is not None else QCatC()  # noqa: E731  (with experts: unused)
        for i, L in enumerate(model.layers):
            tensors += [t for t in (L.attn_norm, L.ffn_norm, L.bqkv, L.q_norm, L.k_norm) if t is not None]
            layers[i] = _LayerC(L.attn_norm.data_ptr(), L.ffn_norm.data_ptr(), ptr(L.bqkv), ptr(L.q_norm),
                                ptr(L.k_norm), c_struct(L.wqkv.q), c_struct(L.wo.q), dense(L.wgu), dense(L.wdown),
                                ctypes.pointer(moe_struct(L.experts)) if L.experts else None,
                                kv_k[i].data_ptr(), kv_v[i].data_ptr())
        self._keep = (tensors, layers, [m.q for L in model.layers for m in (L.wqkv, L.wo, L.wgu, L.wdown)
                                        if m is not None], [L.experts for L in model.layers if L.experts])
        self.model = _ModelC(cfg.n_layers, cfg.hidden, cfg.intermediate, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                             {None: 0, "head": 1, "full": 2}[cfg.qk_norm], cfg.rms_eps, cfg.head_dim ** -0.5,
                             model.cos.data_ptr(),
                             model.sin.data_ptr(), model.norm.data_ptr(), layers)
        self.D = cfg.hidden
        self.lib = native()

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, gather: torch.Tensor,
                 first: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        """x [T, D] embeddings (overwritten: the residual stream) -> [T, D] final-normed hidden.
        The runtime built positions, slots and gather from its own tables (in range)."""
        T = x.shape[0]
        out = torch.empty(T, self.D)
        _sync_threads(self.lib)
        rc = self.lib.sf_decode(ctypes.byref(self.model), x.data_ptr(), T, positions.data_ptr(), slots.data_ptr(),
                                gather.data_ptr(), gather.shape[1], first.data_ptr(), lens.data_ptr(), out.data_ptr())
        _check(rc, "sf_decode")
        return out
