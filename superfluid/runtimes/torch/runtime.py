"""TorchRuntime: the RuntimePrimitives over our Llama forward and the paged KV pool.

A step is: validate every feed, reserve cells for all of them (all or nothing), pack the
tokens into one [T] batch, run ONE forward, then compute the LM head only for the rows
asked for. Sequence lengths advance only after the forward ran.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ...models import DEFAULT_MODEL, ModelLoadError, resolve_model
from ...tokenizer import Tokenizer
from ..base import Feed, MemCounters, OutOfBoundary, RuntimeDesc, SampleSpec, Vocabulary
from .attention import KEY_BLOCK, build_meta
from .gguf_weights import load_gguf, open_gguf
from .heap import give_back_freed_memory, keep_step_heap
from .hf_weights import load_hf
from .llama import Llama
from .paged import PagedKV
from .quant_choice import resolve_quant
from .quantized import FILE_ROUTE
from .sample import sample_lanes


def cpu_has_native_bf16() -> bool:
    try:
        flags = re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        return False
    return bool(flags) and bool({"avx512_bf16", "amx_bf16"} & set(flags.group(1).split()))


def pick_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; one of {', '.join(table)}")
    return table[dtype]


def load_model(path: Path, progress: bool = False, reader=None, blocks: dict | None = None, floats: bool = True):
    """(config, tensors, tokenizer) from a .gguf file (reader: already open; blocks: filled
    with its matrices' own blocks; floats=False: no float copy of the matrices only blocks
    feed, load_gguf) or a Hugging Face folder."""
    if path.suffix == ".gguf":
        reader = reader or open_gguf(path)
        cfg, tensors = load_gguf(path, progress, reader, blocks, floats)
        return cfg, tensors, Tokenizer.from_gguf(path, reader)
    cfg, tensors = load_hf(path, progress)
    return cfg, tensors, Tokenizer.from_hf(path)


class TorchRuntime:
    def __init__(self, model: str | Path = DEFAULT_MODEL, dtype: str | torch.dtype | None = None,
                 device: str | None = None, kv_cache_mb: int = 1024, max_batch: int = 64,
                 max_seq_len: int = 8192, page: int = 16, deterministic: bool = False, progress: bool = False,
                 prefill_step_tokens: int = 512, quant: str | None = "auto", invariant: bool = True):
        """quant: "auto" (a GGUF on CPU: "gguf", each matrix on the kernel for its own
        blocks), "none" (the reference numerics), "q8_0" | "q4_1" (requantized; quant_choice.py). On a quantized route
        ``invariant`` (the default) makes every row a function of that row alone, as
        ``deterministic`` does on the reference route."""
        path = resolve_model(model)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        reader = open_gguf(path) if path.suffix == ".gguf" else None
        quant = resolve_quant(quant, path, self.device)
        deterministic = deterministic or (quant is not None and invariant)
        self.quant = quant
        self.dtype = pick_dtype(dtype or ("float32" if quant else None), self.device)
        blocks = {} if quant == FILE_ROUTE else None
        # the invariant route on the file's blocks reads no matrix's floats (llama.Llama's keep)
        cfg, tensors, self.tokenizer = load_model(path, progress, reader, blocks, floats=not deterministic)
        if self.tokenizer.vocab_size > cfg.vocab_size:
            raise ModelLoadError(f"{path}: tokenizer has {self.tokenizer.vocab_size} tokens, model {cfg.vocab_size}")
        self.cfg = cfg
        self.model = Llama(cfg, tensors, self.dtype, self.device, deterministic, native_bf16=cpu_has_native_bf16(),
                           quant=quant, positions=min(max_seq_len, cfg.max_position), blocks=blocks)
        del tensors, blocks
        give_back_freed_memory()
        keep_step_heap()
        self.deterministic = deterministic
        act = self.model.dtype  # activations and KV (fp32 when bf16 is only used for GEMV)
        cell_bytes = 2 * cfg.n_layers * cfg.kv_size * torch.tensor([], dtype=act).element_size()
        n_blocks = max(1, kv_cache_mb * 2**20 // (cell_bytes * page))
        self.kv = PagedKV(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, n_blocks, page, act, self.device)
        seq_cap = min(max_seq_len, cfg.max_position)  # a sliding window masks keys, it does not cap the context
        self.desc = RuntimeDesc(
            runtime_id=f"torch:{path.name}:{str(self.dtype).removeprefix('torch.')}" + (":det" if deterministic else "")
            + (f":{quant}" if quant else "") + (f":{self.model.route}" if quant == FILE_ROUTE else ""),
            vocab_size=cfg.vocab_size, max_batch=max_batch, max_seq_len=seq_cap, max_seqs=0, page=page,
            prefill_step_tokens=prefill_step_tokens, exact_only=False, truncate_partial=True,
            copy_shares_cells=True, takeover_preferred=False, engine_sampling=True, engine_draws=True,
            verify_batches=True, cell_bytes=self.kv.cell_bytes, batch_invariant=deterministic,
        )
        self._vocab: Vocabulary | None = None
        self._eos = frozenset(self.tokenizer.eos_ids)

    # ---------------------------------------------------------------- sequences

    def seq_create(self) -> int:
        return self.kv.create()

    def seq_copy(self, src: int, dst: int, n_tokens: int) -> None:
        self.kv.copy(src, dst, n_tokens)

    def seq_truncate(self, seq: int, n_tokens: int) -> None:
        self.kv.truncate(seq, n_tokens)

    def seq_free(self, seq: int) -> None:
        self.kv.free(seq)

    def seq_len(self, seq: int) -> int:
        return self.kv.table(seq).length

    def seq_export(self, seq: int) -> dict:
        payload = self.kv.export(seq)
        payload["runtime_id"] = self.desc.runtime_id
        return payload

    def seq_import(self, seq: int, payload: dict) -> int:
        return self.kv.import_(seq, payload)

    # -------------------------------------------------------------------- steps

    def _check(self, feeds: Sequence[Feed]) -> None:
        if not feeds:
            raise ValueError("a step needs at least one feed")
        if len(feeds) > self.desc.max_batch:
            raise OutOfBoundary(f"{len(feeds)} feeds > max_batch {self.desc.max_batch}")
        seen = set()
        for f in feeds:
            t = self.kv.table(f.seq)
            if f.seq in seen:
                raise OutOfBoundary(f"seq {f.seq} fed twice in one step")
            seen.add(f.seq)
            if not len(f.tokens):
                raise OutOfBoundary(f"empty feed for seq {f.seq}")
            if t.length + len(f.tokens) > self.desc.max_seq_len:
                raise OutOfBoundary(f"seq {f.seq}: {t.length} + {len(f.tokens)} tokens > max_seq_len {self.desc.max_seq_len}")
            lo, hi = min(f.tokens), max(f.tokens)
            if lo < 0 or hi >= self.cfg.vocab_size:
                raise OutOfBoundary(f"seq {f.seq}: token id out of range [0, {self.cfg.vocab_size})")

    def _forward(self, feeds: Sequence[Feed]) -> tuple[torch.Tensor, list[int]]:
        """Run one packed forward over every feed; returns hidden [T, D] and row offsets."""
        self._check(feeds)
        q_lens = [len(f.tokens) for f in feeds]
        starts = [self.kv.table(f.seq).length for f in feeds]
        new_slots = self.kv.reserve([(f.seq, n) for f, n in zip(feeds, q_lens)])
        key_slots = [self.kv.slots(self.kv.table(f.seq), 0, s + n) for f, s, n in zip(feeds, starts, q_lens)]
        meta = build_meta(q_lens, starts, torch.cat(new_slots), key_slots, self.device,
                          KEY_BLOCK if self.deterministic else 1)
        tokens = torch.tensor([t for f in feeds for t in f.tokens], dtype=torch.int64, device=self.device)
        hidden = self.model.forward(tokens, meta, self.kv.k, self.kv.v)
        for f, n in zip(feeds, q_lens):
            self.kv.commit(f.seq, n)
        return hidden, meta.offsets

    def _rows(self, hidden: torch.Tensor, idx: list[int]) -> np.ndarray:
        if not idx:
            return np.zeros((0, self.cfg.vocab_size), dtype=np.float32)
        sel = hidden[torch.tensor(idx, device=hidden.device)]
        return self.model.logits(sel).cpu().numpy()  # [R, V] float32

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        hidden, offsets = self._forward(feeds)
        idx = [o + len(f.tokens) - 1 for f, o in zip(feeds, offsets) if f.wants_row]
        return list(self._rows(hidden, idx))

    def step_rows(self, feeds: Sequence[Feed]) -> list[list[np.ndarray]]:
        hidden, offsets = self._forward(feeds)
        rows = self._rows(hidden, list(range(hidden.shape[0])))
        return [list(rows[o: o + len(f.tokens)]) for f, o in zip(feeds, offsets)]

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec]) -> list[int]:
        if len(specs) != len(feeds):
            raise ValueError(f"{len(specs)} sample specs for {len(feeds)} feeds")
        hidden, offsets = self._forward(feeds)
        idx = [o + len(f.tokens) - 1 for f, o in zip(feeds, offsets)]
        with torch.inference_mode():
            logits = self.model.logits(hidden[torch.tensor(idx, device=hidden.device)])  # [B, V] float32
            return sample_lanes(logits, specs)

    # ----------------------------------------------------------------- counters

    def mem_counters(self) -> MemCounters:
        """cells_total / cells_used in cells (whole blocks); allocated_bytes: bytes of used cells."""
        used = self.kv.used_blocks * self.kv.page
        return MemCounters(cells_total=self.kv.n_blocks * self.kv.page, cells_used=used,
                           allocated_bytes=used * self.kv.cell_bytes)

    def cells_released(self, seqs: Sequence[int]) -> int:
        return self.kv.released_cells(seqs)

    def sync_steps(self, on: bool) -> None:
        """Steps are synchronous on CPU; on CUDA every step ends with a host copy anyway."""

    def vocabulary(self) -> Vocabulary:
        if self._vocab is None:
            self._vocab = self.tokenizer.vocabulary()
        return self._vocab

    def is_eos(self, token: int) -> bool:
        return token in self._eos
