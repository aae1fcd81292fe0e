"""Load a Llama-family GGUF file: ModelConfig from metadata, fp32 tensors by dequantizing.

GGUF stores matrices as [out, in] in numpy order (ggml's ne is reversed). For the
``llama`` architecture llama.cpp permutes the rows of attn_q / attn_k so that RoPE can
rotate interleaved pairs; we undo it (as transformers' gguf loader does) and use the
rotate-half RoPE of Hugging Face models everywhere.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGMLQuantizationType
from gguf.quants import dequantize

from ...gguf_header import check_header
from ...models import MAX_SIZE, ModelLoadError, check_size
from .config import ModelConfig, RopeScaling, check_shapes
from .qmat import NATIVE
from . import quantized

SUPPORTED_QUANTS = (  # what gguf.quants.dequantize reads that llama.cpp writes for Llama-family weights
    GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q2_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
)

_LAYER_NAMES = {  # gguf suffix -> canonical suffix
    "attn_norm.weight": "attn_norm", "attn_q.weight": "q", "attn_k.weight": "k", "attn_v.weight": "v",
    "attn_q.bias": "q_bias", "attn_k.bias": "k_bias", "attn_v.bias": "v_bias", "attn_output.weight": "o",
    "ffn_norm.weight": "ffn_norm", "ffn_gate.weight": "gate", "ffn_up.weight": "up", "ffn_down.weight": "down",
    "attn_q_norm.weight": "q_norm", "attn_k_norm.weight": "k_norm", "post_attention_norm.weight": "post_attn_norm",
    "post_ffw_norm.weight": "post_ffn_norm", "ffn_gate_inp.weight": "router", "ffn_gate_exps.weight": "gate_exps",
    "ffn_up_exps.weight": "up_exps", "ffn_down_exps.weight": "down_exps",
    "attn_qkv.weight": "qkv",  # fused (Phi-3): split by _split_fused
}
# general.architecture -> ModelConfig.arch, for the files torch runs (tests/test_architectures_gguf.py
# converts a tiny model of each with llama.cpp's own converter). A Mixtral file says "llama".
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe",
                      "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3", "smollm3": "smollm3",
                      "olmo2": "olmo2", "olmoe": "olmoe", "granite": "granite"}
_PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's converter interleaves these q/k rows for its RoPE
_GLOBAL_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head",
                 "rope_freqs.weight": "rope_freqs"}


def gguf_name(key: str) -> str:
    """Canonical name -> the GGUF tensor name (for error messages)."""
    if key.startswith("layers."):
        _, idx, suffix = key.split(".", 2)
        return f"blk.{idx}." + next(g for g, c in _LAYER_NAMES.items() if c == suffix)
    return next(g for g, c in _GLOBAL_NAMES.items() if c == key)


class _Reader(GGUFReader):
    def _build_tensors(self, start_offs, fields):
        # GGUFReader fails on a type id it does not know with a bare "99 is not a valid
        # GGMLQuantizationType"; name the tensor first. field.parts: name_len, name, n_dims, dims, type, offset.
        known = {int(q) for q in GGMLQuantizationType}
        for f in fields:
            if int(f.parts[4][0]) not in known:
                raise ValueError(f"tensor {bytes(f.parts[1]).decode(errors='replace')!r} has unknown ggml type "
                                 f"{int(f.parts[4][0])}")
        return super()._build_tensors(start_offs, fields)


def open_gguf(path: Path) -> GGUFReader:
    try:
        return _Reader(path)
    except Exception as e:  # truncated headers, bad magic, short tensor data
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def field(reader: GGUFReader, key: str, path: Path, default=None, required: bool = True):
    f = reader.fields.get(key)
    if f is None:
        if required and default is None:
            raise ModelLoadError(f"{path}: missing metadata field {key!r}")
        return default
    try:
        return f.contents()
    except Exception as e:
        raise ModelLoadError(f"{path}: unreadable metadata field {key!r} ({e})") from e


def read_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture", path)
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: the torch runtime does not run architecture {arch!r} (field "
                             f"general.architecture; it runs {', '.join(GGUF_ARCHITECTURES)}): the llamacpp runtime "
                             f"does (--runtime llamacpp, or --runtime auto, the default, picks it)")
    check_header(reader, path)
    def a(k, d=None):
        return field(reader, f"{arch}.{k}", path, d)

    def opt(k):
        return field(reader, f"{arch}.{k}", path, required=False)

    def size(k, d=None, limit=MAX_SIZE):  # every count the header declares, bounded before it sizes or loops
        return check_size(f"{arch}.{k}", a(k, d), str(path), limit)

    hidden, n_heads = size("embedding_length"), size("attention.head_count")
    n_kv = size("attention.head_count_kv", n_heads)
    head_dim = size("attention.key_length", max(hidden // n_heads, 1))
    names = [t.name for t in reader.tensors]
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = size("vocab_size", int(embd.shape[-1]))
    context = size("context_length", 2048, limit=2**64)  # only a claim: tables stop at the positions served
    n_layers = size("block_count")
    n_experts = check_size(f"{arch}.expert_count", opt("expert_count"), str(path)) if opt("expert_count") else 0
    ffn = size("expert_feed_forward_length") if n_experts and opt("expert_feed_forward_length") else \
        size("feed_forward_length")
    scaling = _rope_scaling(reader, path, arch, context)
    window = opt("attention.sliding_window")
    pattern = opt("attention.sliding_window_pattern")
    options = _options(reader, path, arch, n_layers, head_dim, n_experts)
    if arch == "gemma3":  # llama.cpp: every sixth layer global unless the file says otherwise
        pattern = pattern if isinstance(pattern, list) else [(i + 1) % 6 != 0 for i in range(n_layers)]
    if arch == "gemma2":  # llama.cpp and transformers: the even layers slide, the odd are global
        pattern = [i % 2 == 0 for i in range(n_layers)]
    sliding = None
    if window and isinstance(pattern, list) and len(set(pattern)) > 1:
        sliding = tuple(bool(x) for x in pattern)
    if isinstance(pattern, list) and pattern and not any(pattern):
        window = None  # no layer slides
    try:
        return ModelConfig(
            arch=GGUF_ARCHITECTURES[arch], vocab_size=vocab, hidden=hidden, intermediate=ffn,
            n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            rope_theta=float(a("rope.freq_base", 10000.0)),
            rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position=context,
            attention_bias="blk.0.attn_q.bias" in names,
            tie_embeddings="output.weight" not in names,
            rope_scaling=scaling,
            sliding_window=check_size(f"{arch}.attention.sliding_window", window, str(path)) if window else None,
            layer_sliding=sliding, **options,
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: inconsistent metadata: {e}") from e


def _options(reader: GGUFReader, path: Path, arch: str, n_layers: int, head_dim: int, n_experts: int) -> dict:
    """The architecture options (config.py's module doc) as llama.cpp reads them from this arch's file."""
    opt = lambda k: field(reader, f"{arch}.{k}", path, required=False)  # noqa: E731
    q_norm = next((t for t in reader.tensors if t.name == "blk.0.attn_q_norm.weight"), None)
    o: dict = {}
    if q_norm is not None:
        o["qk_norm"] = "head" if int(q_norm.shape[0]) == head_dim else "full"
    if arch == "olmo2":
        o |= {"pre_norm": False, "post_norm": True}
    if arch in ("gemma2", "gemma3"):  # norms stored with Gemma's +1 folded in by the converter
        hidden = float(field(reader, f"{arch}.embedding_length", path))
        o |= {"post_norm": True, "activation": "gelu_tanh", "attn_scale": head_dim ** -0.5, "embed_scale": hidden ** 0.5}
    if arch == "gemma3":
        o["local_rope_theta"] = float(opt("rope.freq_base_swa") or 10000.0)
    if arch == "gemma2":  # the file has no query_pre_attn_scalar: llama.cpp's rule, by size (27B: hidden / heads)
        if n_layers == 46:
            o["attn_scale"] = (hidden / int(field(reader, f"{arch}.attention.head_count", path))) ** -0.5
        o |= {"attn_softcap": float(opt("attn_logit_softcapping") or 0) or None,
              "final_softcap": float(opt("final_logit_softcapping") or 0) or None}
    if arch == "granite":
        o |= {"embed_scale": float(opt("embedding_scale") or 1.0), "residual_scale": float(opt("residual_scale") or 1.0),
              "attn_scale": float(opt("attention.scale") or head_dim ** -0.5), "logit_scale": float(opt("logit_scale") or 1.0)}
    if arch == "smollm3":  # llama.cpp: every fourth layer without RoPE
        o["layer_rope"] = tuple((i + 1) % 4 != 0 for i in range(n_layers))
    dims = opt("rope.dimension_count")
    if dims and int(dims) < head_dim:
        o["rotary_dim"] = int(dims)
    if n_experts:
        o |= {"n_experts": n_experts, "n_experts_used": int(opt("expert_used_count") or 0),
              "moe_norm_topk": arch in ("llama", "qwen3moe")}  # llama.cpp's choice per architecture
    return o


def _rope_scaling(reader: GGUFReader, path: Path, arch: str, context: int) -> RopeScaling | None:
    k = lambda name: field(reader, f"{arch}.rope.scaling.{name}", path, required=False)  # noqa: E731
    kind, factor = k("type"), k("factor")
    factors = {t.name: t for t in reader.tensors if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2:  # Phi-3's LongRoPE: per-frequency divisors within and beyond the original context
        orig = int(k("original_context_length") or context)
        long, short = (tuple(float(v) for v in np.asarray(factors[f"rope_factors_{n}.weight"].data, dtype=np.float32))
                       for n in ("long", "short"))
        attn = k("attn_factor")
        return RopeScaling("longrope", context / orig, original_max_position=orig, short_factors=short,
                           long_factors=long, attention_factor=float(attn) if attn is not None else None)
    if kind == "linear" and factor and float(factor) != 1.0:
        return RopeScaling("linear", float(factor))
    if kind == "yarn" and factor:
        # convert_hf_to_gguf writes transformers' rope_parameters here: factor,
        # original_context_length, and when the config had them beta_fast / beta_slow and
        # attention_factor (as yarn_attn_factor); the rest take transformers' defaults.
        attn, fast, slow = k("yarn_attn_factor"), k("yarn_beta_fast"), k("yarn_beta_slow")
        return RopeScaling("yarn", float(factor), original_max_position=int(k("original_context_length") or context),
                           beta_fast=float(fast or 32), beta_slow=float(slow or 1),
                           attention_factor=float(attn) if attn is not None else None)
    if kind not in (None, "none", "linear", "yarn"):  # linear / yarn without a factor: no scaling
        raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r} (field {arch}.rope.scaling.type)")
    return None


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp: w.reshape(n_head, 2, dim, ...).swapaxes(1, 2); this is its inverse.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _tensor(t, path: Path) -> np.ndarray:
    qtype = GGMLQuantizationType(t.tensor_type)
    if qtype not in SUPPORTED_QUANTS:
        raise ModelLoadError(f"{path}: tensor {t.name!r} has unsupported type {qtype.name} "
                             f"(supported: {', '.join(q.name for q in SUPPORTED_QUANTS)})")
    shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne -> numpy order
    try:
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.asarray(t.data, dtype=np.float32)
        else:
            arr = dequantize(t.data, qtype)
        arr = arr.reshape(shape)
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name!r} is unreadable ({type(e).__name__}: {e})") from e
    if not np.isfinite(arr).all():  # a NaN weight poisons every row it touches
        raise ModelLoadError(f"{path}: tensor {t.name!r} holds NaN or infinite values")
    return arr


def _key(name: str, arch: str) -> str | None:
    """A GGUF tensor name -> its canonical name (None: a tensor the model does not use)."""
    key = _GLOBAL_NAMES.get(name)
    if key is None and name.startswith("blk."):
        _, idx, suffix = name.split(".", 2)
        if suffix in _LAYER_NAMES and idx.isdigit():
            key = f"layers.{idx}.{_LAYER_NAMES[suffix]}"
            if arch == "phi3" and suffix == "ffn_up.weight":
                key = f"layers.{idx}.gate_up"  # gate rows then up rows, one matrix (_split_fused)
    return key


_FUSED_GROUPS = (("q", "k", "v"), ("gate", "up"), ("gate_exps", "up_exps"))  # stacked into one matrix (Src.cat)
# Each GGUF block type's fp16 scale fields (byte offsets in a block): a non-finite one is a
# NaN weight, checked on the blocks where no float copy is made.
_HALF_FIELDS = {GGMLQuantizationType.Q8_0: (0,), GGMLQuantizationType.Q4_0: (0,), GGMLQuantizationType.Q4_1: (0, 2),
                GGMLQuantizationType.Q5_0: (0,), GGMLQuantizationType.Q5_1: (0, 2), GGMLQuantizationType.Q4_K: (0, 2),
                GGMLQuantizationType.Q5_K: (0, 2), GGMLQuantizationType.Q6_K: (208,)}


def _blocks_only(reader: GGUFReader, arch: str) -> set[str]:
    """The matrices whose floats nothing reads when every product runs on the file's blocks:
    each in a type a kernel reads as it is, as is every matrix it is stacked with (a part
    requantized from floats needs its floats; the stack is built from both). The embedding
    table too where it is gathered from its blocks (over EMBED_FLOATS_MAX in fp32: llama.Llama)."""
    qtypes = {_key(t.name, arch): GGMLQuantizationType(t.tensor_type) for t in reader.tensors
              if len(t.shape) >= 2 and _key(t.name, arch)}
    sizes = {_key(t.name, arch): int(np.prod(t.shape)) for t in reader.tensors}
    native = {k for k, q in qtypes.items() if q in NATIVE and (k != "embed" or sizes[k] * 4 > quantized.EMBED_FLOATS_MAX)}
    for k in list(native):
        if k.startswith("layers."):
            p, suffix = k.rsplit(".", 1)
            group = next((g for g in _FUSED_GROUPS if suffix in g), (suffix,))
            if any(f"{p}.{m}" in qtypes and f"{p}.{m}" not in native for m in group):
                native.discard(k)
    return native


def _check_scales(t, path: Path) -> None:
    qtype = GGMLQuantizationType(t.tensor_type)
    try:
        raw = np.asarray(t.data, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[qtype][1])
        finite = all(np.isfinite(np.ascontiguousarray(raw[:, off: off + 2]).view(np.float16)).all()
                     for off in _HALF_FIELDS[qtype])
    except Exception as e:
        raise ModelLoadError(f"{path}: tensor {t.name!r} is unreadable ({type(e).__name__}: {e})") from e
    if not finite:
        raise ModelLoadError(f"{path}: tensor {t.name!r} holds NaN or infinite values")


def load_gguf(path: Path, progress: bool = False, reader: GGUFReader | None = None,
              blocks: dict | None = None, floats: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, canonical name -> float32 tensor). Raises ModelLoadError naming file and tensor.
    ``blocks``, when given, is filled with canonical name -> (type, uint8 [rows..., row bytes])
    for each matrix, the bytes where its type is one the native kernels read as it is
    (qmat.NATIVE; else None), rows in the order of the float tensor (q/k un-permuted alike).
    ``floats=False`` (with blocks: a route where every product runs on the file's blocks):
    the matrices no float of which is read (_blocks_only) are meta tensors, their shape only,
    so a load never holds the model in fp32 (a 3B file's 13 GB)."""
    path = Path(path)
    reader = reader or open_gguf(path)
    cfg = read_config(reader, path)
    names: dict[str, str] = {}
    out: dict[str, torch.Tensor] = {}
    meta = _blocks_only(reader, field(reader, "general.architecture", path)) if blocks is not None and not floats \
        else set()
    tensors = reader.tensors
    if progress:
        from tqdm import tqdm
        tensors = tqdm(tensors, desc=f"loading {path.name}")
    for t in tensors:
        key = _key(t.name, cfg.arch)
        if key is None:
            continue  # tensors the model does not use
        names[key] = t.name
        shape = tuple(int(x) for x in reversed(t.shape))  # ggml ne -> numpy order
        if key in meta:
            _check_scales(t, path)
            w = None  # shape only: a meta tensor below
        else:
            w = _tensor(t, path)
        raw = None
        if blocks is not None and GGMLQuantizationType(t.tensor_type) in NATIVE and len(t.shape) >= 2:
            raw = np.asarray(t.data, dtype=np.uint8).reshape(*shape[:-1], -1)
        if cfg.arch in _PERMUTED and key.endswith((".q", ".k")):
            heads = cfg.n_heads if key.endswith(".q") else cfg.n_kv_heads
            if shape[0] % (2 * heads):
                raise ModelLoadError(f"{path}: tensor {t.name!r} has {shape[0]} rows, not divisible into {heads} heads")
            w = _unpermute(w, heads) if w is not None else None
            raw = _unpermute(raw, heads) if raw is not None else None
        if blocks is not None and len(t.shape) >= 2:  # the type always (the route's name), blocks where a kernel reads them
            blocks[key] = (GGMLQuantizationType(t.tensor_type), torch.from_numpy(np.array(raw)) if raw is not None
                           else None)  # a copy: the map is read-only
        if w is None:
            out[key] = torch.empty(shape, dtype=torch.float32, device="meta")
            continue
        w = np.ascontiguousarray(w, dtype=np.float32)
        out[key] = torch.from_numpy(w if w.flags.writeable else w.copy())
    _split_fused(cfg, out, blocks, names, path)
    for key in cfg.expected_shapes():
        names.setdefault(key, gguf_name(key))
    check_shapes(cfg, out, str(path), names)
    return cfg, out


def _split_fused(cfg: ModelConfig, out: dict, blocks: dict | None, names: dict, path: Path) -> None:
    """Phi-3's fused attn_qkv ([q; k; v] rows) and ffn_up ([gate; up] rows) as the separate
    matrices the layer stacks again (Src.cat): rows only, so each part keeps the file's
    blocks as they are."""
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        for fused, parts, sizes in ((p + "qkv", "qkv", (cfg.q_size, cfg.kv_size, cfg.kv_size)),
                                    (p + "gate_up", ("gate", "up"), (cfg.intermediate, cfg.intermediate))):
            if fused not in out:
                continue
            w = out.pop(fused)
            if w.shape[0] != sum(sizes):
                raise ModelLoadError(f"{path}: tensor {names[fused]!r} has {w.shape[0]} rows, expected {sum(sizes)}")
            raw = blocks.pop(fused) if blocks is not None and fused in blocks else None
            lo = 0
            for part, n in zip(parts, sizes):
                out[p + part] = w[lo: lo + n]
                names[p + part] = names[fused]
                if raw is not None:
                    blocks[p + part] = (raw[0], raw[1][lo: lo + n] if raw[1] is not None else None)
                lo += n
