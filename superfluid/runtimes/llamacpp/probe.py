"""What the runtime needs to know of a loaded llama.cpp model before it makes its context."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L

from .lib import ContextSpec, new_context


@dataclass(frozen=True)
class ModelFacts:
    arch: str
    n_vocab: int
    n_ctx_train: int
    eos: int  # -1: none
    recurrent: bool  # Mamba, Mamba2, RWKV: one state per sequence, no partial cut
    hybrid: bool  # attention layers and recurrent ones (Jamba, Granite-H, Falcon-H1, ...)


def _meta(model, key: str) -> str:
    buf = ctypes.create_string_buffer(256)
    n = L.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace") if n >= 0 else ""


def model_facts(model) -> ModelFacts:
    vocab = L.llama_model_get_vocab(model)
    return ModelFacts(
        arch=_meta(model, "general.architecture") or "unknown",
        n_vocab=L.llama_vocab_n_tokens(vocab),
        n_ctx_train=L.llama_model_n_ctx_train(model),
        eos=L.llama_vocab_eos(vocab),
        recurrent=bool(L.llama_model_is_recurrent(model)),
        hybrid=bool(L.llama_model_is_hybrid(model)),
    )


def probe_cell_bytes(model, path: Path, n_threads: int, kv_f32: bool) -> int:
    """Bytes one KV cell takes, measured on a throw-away context: the growth of one
    sequence's exported state from one token to two (K and V of every layer)."""
    ctx = new_context(model, ContextSpec(n_ctx=256, n_batch=8, n_ubatch=8, n_seq_max=1, n_threads=n_threads,
                                         kv_f32=kv_f32), path)
    batch = L.llama_batch_init(1, 0, 1)
    try:
        sizes = []
        for pos in range(2):
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = 0, pos, 1, 0
            batch.seq_id[0][0] = 0
            if L.llama_decode(ctx, batch) != 0:
                return 1
            sizes.append(L.llama_state_seq_get_size(ctx, 0))
        return max(int(sizes[1] - sizes[0]), 1)
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
