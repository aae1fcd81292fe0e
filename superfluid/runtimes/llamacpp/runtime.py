"""LlamaCppRuntime: the RuntimePrimitives over llama.cpp's low-level C API.

Mapping (DESIGN §4):
- a sequence is a llama.cpp sequence id in [0, n_seq_max); ``seq_create`` hands out a
  free one (none free: ``Capacity``; ``desc.max_seqs`` tells the executor beforehand);
- ``step`` / ``step_rows`` are ONE ``llama_decode`` over every feed, logits flags only on
  the rows asked for (all of them for draft verification); rc 1 (no KV slot) is
  ``Capacity`` (the lane faults OOM_TENTATIVE, the scheduler preempts), any other
  failure ``Fatal`` (the worker exits 70 and the daemon replays);
- ``step_sampled`` samples each feed's last row where llama.cpp left it, with the host's
  own sampler (logits.py): greedy and seeded lanes get the host path's tokens, and no
  row is copied out;
- ``seq_copy`` is ``llama_memory_seq_cp`` over the prefix: with the unified KV it shares
  cells; a recurrent state is copied whole or not at all;
- ``seq_truncate`` is ``llama_memory_seq_rm`` from the cut on; a refusal (a recurrent
  state cannot be cut back part-way) is ``Unsupported``: such a model is ``exact_only``;
- export / import are ``llama_state_seq_get_data`` / ``set_data``;
- cells are counted by ``CellLedger``, a mirror updated only after llama.cpp acted.

Lengths are ours too, cross-checked with ``llama_memory_seq_pos_max`` in the tests.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import numpy as np

import llama_cpp as L

from ...gguf_header import check_file
from ...models import DEFAULT_MODEL, ModelLoadError, resolve_model
from ..base import (Capacity, Fatal, Feed, MemCounters, OutOfBoundary, RuntimeDesc, SampleSpec, Unsupported,
                    UnknownSeq, Vocabulary)
from .batch import StepBatch
from .cells import CellLedger
from .lib import ContextSpec, default_threads, load_model, new_context, recent_errors
from .logits import LogitsView, sample_rows
from .probe import ModelFacts, model_facts, probe_cell_bytes
from .tokenizer import gguf_tokenizer

PAYLOAD_KIND = "llamacpp-seq-state"


class LlamaCppRuntime:
    def __init__(self, model: str | Path = DEFAULT_MODEL, max_batch: int = 16, max_seqs: int = 0,
                 n_ctx: int = 16384, kv_cache_mb: int = 0, max_seq_len: int = 8192, page: int = 1,
                 prefill_step_tokens: int = 512, n_threads: int = 0, n_ubatch: int = 512, kv_f32: bool = False,
                 extra_bufts: bool = False):
        """n_ctx: KV cells in the one unified pool (kv_cache_mb, if given, sizes it instead);
        max_seqs: llama.cpp sequence ids (default 4 x max_batch: lanes and cache entries
        both hold one; at most 256); kv_f32: fp32 K/V instead of llama.cpp's fp16;
        extra_bufts: llama.cpp's repacked weight layouts (lib.load_model says why off);
        page: the prefix cache's granularity in tokens. 1: llama.cpp's cells are not paged
        and ``seq_cp`` shares any prefix, so a cached prefix is used to the token, as
        llama-server's slots use theirs (16 would leave up to 15 tokens of every hit to prefill
        again: a short shared system prompt would mostly miss)."""
        path = resolve_model(model)
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: the llamacpp runtime loads .gguf files only")
        self.path = path
        check_file(path)  # llama.cpp aborts the process on a count it does not believe
        self.tokenizer = gguf_tokenizer(path)  # also a first check of the file (truncation, fields)
        self.model = load_model(path, extra_bufts)
        self._ctx = None
        self._batch: StepBatch | None = None
        try:
            self._setup(max_batch, max_seqs, n_ctx, kv_cache_mb, max_seq_len, page, prefill_step_tokens,
                        n_threads or default_threads(), n_ubatch, kv_f32)
        except BaseException:
            self.close()
            raise

    def _setup(self, max_batch, max_seqs, n_ctx, kv_cache_mb, max_seq_len, page, prefill_step_tokens,
               n_threads, n_ubatch, kv_f32) -> None:
        path = self.path
        facts: ModelFacts = model_facts(self.model)
        self.facts = facts
        if self.tokenizer.vocab_size > facts.n_vocab:
            raise ModelLoadError(f"{path}: vocabulary mismatch: the tokenizer has {self.tokenizer.vocab_size} tokens, "
                                 f"llama.cpp's model {facts.n_vocab}")
        if facts.eos >= 0 and not self.tokenizer.eos_ids:
            raise ModelLoadError(f"{path}: vocabulary mismatch: llama.cpp's EOS {facts.eos} is no end token of the tokenizer")
        recurrent = facts.recurrent or facts.hybrid
        max_seqs = min(max_seqs or 4 * max_batch, 256)
        max_batch = min(max_batch, max_seqs)
        if kv_cache_mb and not facts.recurrent:
            per_cell = probe_cell_bytes(self.model, path, n_threads, kv_f32)
            n_ctx = max(256, kv_cache_mb * 2**20 // max(per_cell, 1))
        # One decode carries a prefill step (plus one pending token per lane) or every lane's
        # verified draft: the batch is sized for the larger.
        n_batch = max(prefill_step_tokens + max_batch, 64 * max_batch, n_ubatch)
        spec = ContextSpec(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch), n_seq_max=max_seqs,
                           n_threads=n_threads, kv_f32=kv_f32)
        self._ctx = new_context(self.model, spec, path)
        self._mem = L.llama_get_memory(self._ctx)
        self._batch = StepBatch(n_batch)
        self._logits = LogitsView(self._ctx, facts.n_vocab)
        cells = 0 if facts.recurrent else L.llama_n_ctx(self._ctx)
        cell_bytes = self._measure_cell_bytes()
        seq_cap = min(max_seq_len, facts.n_ctx_train or max_seq_len)
        if cells:
            seq_cap = min(seq_cap, cells)
        self.ledger = CellLedger(cells) if cells else None
        self._free_ids = list(range(max_seqs - 1, -1, -1))
        self._len: dict[int, int] = {}
        self.desc = RuntimeDesc(
            runtime_id=f"llamacpp:{path.name}:{facts.arch}" + (":f32kv" if kv_f32 else ""),
            vocab_size=facts.n_vocab, max_batch=max_batch, max_seq_len=seq_cap, max_seqs=max_seqs, page=page,
            prefill_step_tokens=prefill_step_tokens, exact_only=recurrent, truncate_partial=not recurrent,
            copy_shares_cells=not recurrent, takeover_preferred=recurrent, engine_sampling=True,
            engine_draws=True, verify_batches=True, cell_bytes=cell_bytes, batch_invariant=False,
        )
        self._vocab: Vocabulary | None = None
        self._eos = frozenset(self.tokenizer.eos_ids) | ({facts.eos} if facts.eos >= 0 else set())

    def _measure_cell_bytes(self) -> int:
        """Bytes of one cell (KV) or of one sequence's state (recurrent), from the sizes of
        a sequence's exported state after one and two tokens; also a first decode, so a
        model that loads but cannot run fails here, before the server says healthy."""
        seq = 0
        sizes = []
        for pos in range(2):
            self._batch.fill([Feed(seq, [0], pos == 1)], [pos], every=False)
            rc = L.llama_decode(self._ctx, self._batch.raw)
            if rc != 0:
                raise ModelLoadError(f"{self.path}: llama.cpp cannot run it (llama_decode returned {rc}: {recent_errors()})")
            sizes.append(L.llama_state_seq_get_size(self._ctx, seq))
        L.llama_memory_clear(self._mem, True)
        if self.facts.recurrent:
            return int(sizes[0])
        return max(int(sizes[1] - sizes[0]), 1)

    def close(self) -> None:
        if self._batch is not None:
            self._batch.close()
            self._batch = None
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None
        if self.model:
            L.llama_model_free(self.model)
            self.model = None

    def __del__(self):  # the worker exits without it; tests build many runtimes
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- sequences

    def _known(self, seq: int) -> int:
        n = self._len.get(seq)
        if n is None:
            raise UnknownSeq(f"seq {seq}")
        return n

    def seq_create(self) -> int:
        if not self._free_ids:
            raise Capacity(f"all {self.desc.max_seqs} llama.cpp sequence ids are in use")
        seq = self._free_ids.pop()
        self._len[seq] = 0
        if self.ledger is not None:
            self.ledger.open(seq)
        return seq

    def seq_copy(self, src: int, dst: int, n_tokens: int) -> None:
        have = self._known(src)
        if self._known(dst) != 0 or n_tokens > have:
            raise Unsupported("copy into a non-empty sequence or past the source")
        if n_tokens == 0:
            return
        if self.desc.exact_only and n_tokens != have:
            raise Unsupported("a recurrent state is copied whole")
        L.llama_memory_seq_cp(self._mem, src, dst, 0, n_tokens)
        self._len[dst] = n_tokens
        if self.ledger is not None:
            self.ledger.share(src, dst, n_tokens)

    def seq_truncate(self, seq: int, n_tokens: int) -> None:
        have = self._known(seq)
        if n_tokens > have:
            raise Unsupported("truncate past the end")
        if n_tokens == have:
            return
        if not L.llama_memory_seq_rm(self._mem, seq, n_tokens if n_tokens else -1, -1):
            raise Unsupported(f"llama.cpp refuses to cut seq {seq} back from {have} to {n_tokens} tokens")
        self._len[seq] = n_tokens
        if self.ledger is not None:
            self.ledger.cut(seq, n_tokens)

    def seq_free(self, seq: int) -> None:
        if seq not in self._len:
            return
        L.llama_memory_seq_rm(self._mem, seq, -1, -1)  # a whole removal never fails
        del self._len[seq]
        if self.ledger is not None:
            self.ledger.close(seq)
        self._free_ids.append(seq)

    def seq_len(self, seq: int) -> int:
        return self._known(seq)

    def seq_export(self, seq: int) -> dict:
        n = self._known(seq)
        size = L.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        got = L.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if got != size:
            raise Fatal(f"llama_state_seq_get_data wrote {got} of {size} bytes")
        return {"kind": PAYLOAD_KIND, "runtime_id": self.desc.runtime_id, "n_tokens": n, "data": bytes(buf)}

    def seq_import(self, seq: int, payload: dict) -> int:
        if self._known(seq) != 0:
            raise Unsupported("import into a non-empty sequence")
        if not isinstance(payload, dict) or payload.get("kind") != PAYLOAD_KIND:
            raise Unsupported("not a llama.cpp sequence state")
        if payload.get("runtime_id") != self.desc.runtime_id:
            raise Unsupported(f"a state of {payload.get('runtime_id')!r}, not of {self.desc.runtime_id!r}")
        n, data = int(payload["n_tokens"]), payload["data"]
        if self.ledger is not None and n > self.ledger.free:
            raise Capacity(f"{n} cells wanted for the import, {self.ledger.free} free")
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if L.llama_state_seq_set_data(self._ctx, buf, len(data), seq) == 0:
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise Unsupported(f"llama.cpp refused the state of {n} tokens")
        held = L.llama_memory_seq_pos_max(self._mem, seq) + 1
        if held != n:
            L.llama_memory_seq_rm(self._mem, seq, -1, -1)
            raise Unsupported(f"the imported state holds {held} tokens, the payload says {n}")
        self._len[seq] = n
        if self.ledger is not None:
            self.ledger.append(seq, n)
        return n

    # -------------------------------------------------------------------- steps

    def _check(self, feeds: Sequence[Feed]) -> list[int]:
        if not feeds:
            raise ValueError("a step needs at least one feed")
        if len(feeds) > self.desc.max_batch:
            raise OutOfBoundary(f"{len(feeds)} feeds > max_batch {self.desc.max_batch}")
        starts, seen = [], set()
        for f in feeds:
            have = self._known(f.seq)
            if f.seq in seen:
                raise OutOfBoundary(f"seq {f.seq} fed twice in one step")
            seen.add(f.seq)
            if not len(f.tokens):
                raise OutOfBoundary(f"empty feed for seq {f.seq}")
            if have + len(f.tokens) > self.desc.max_seq_len:
                raise OutOfBoundary(f"seq {f.seq}: {have} + {len(f.tokens)} tokens > max_seq_len {self.desc.max_seq_len}")
            if min(f.tokens) < 0 or max(f.tokens) >= self.desc.vocab_size:
                raise OutOfBoundary(f"seq {f.seq}: token id out of range [0, {self.desc.vocab_size})")
            starts.append(have)
        if sum(len(f.tokens) for f in feeds) > self._batch.capacity:
            raise OutOfBoundary(f"a step of more than {self._batch.capacity} tokens")
        return starts

    def _decode(self, feeds: Sequence[Feed], every: bool, last: bool = False) -> tuple[list[list[int]], int]:
        """One llama_decode over every feed; returns the batch's output indexes per feed
        (see StepBatch.fill) and how many rows llama.cpp now holds."""
        starts = self._check(feeds)
        outs = self._batch.fill(feeds, starts, every, last)
        rc = L.llama_decode(self._ctx, self._batch.raw)
        if rc == 1:  # no KV slot: nothing of the batch went in
            raise Capacity(f"llama.cpp found no KV cells for {self._batch.raw.n_tokens} tokens")
        if rc != 0:
            raise Fatal(f"llama_decode returned {rc} ({recent_errors()})")
        for f in feeds:
            self._len[f.seq] += len(f.tokens)
            if self.ledger is not None:
                self.ledger.append(f.seq, len(f.tokens))
        return outs, sum(len(o) for o in outs)

    def _copied_rows(self, outs: list[list[int]], n: int) -> list[list[np.ndarray]]:
        """Each feed's rows, copied out of llama.cpp's buffer (the next decode overwrites
        it) in one copy; rows are in batch order, so feed by feed."""
        if not n:
            return [[] for _ in outs]
        held = self._logits.rows(n).copy()
        rows, at = [], 0
        for idx in outs:
            rows.append(list(held[at: at + len(idx)]))
            at += len(idx)
        return rows

    def step(self, feeds: Sequence[Feed]) -> list[np.ndarray]:
        outs, n = self._decode(feeds, every=False)
        rows = self._copied_rows(outs, n)
        return [r[0] for r, f in zip(rows, feeds) if f.wants_row]

    def step_rows(self, feeds: Sequence[Feed]) -> list[list[np.ndarray]]:
        outs, n = self._decode(feeds, every=True)
        return self._copied_rows(outs, n)

    def step_sampled(self, feeds: Sequence[Feed], specs: Sequence[SampleSpec]) -> list[int]:
        """Every feed's last row sampled where llama.cpp left it (logits.py: the host's
        own sampler on the same values, so the same tokens); no row leaves the runtime."""
        if len(specs) != len(feeds):
            raise ValueError(f"{len(specs)} sample specs for {len(feeds)} feeds")
        _, n = self._decode(feeds, every=False, last=True)
        return sample_rows(self._logits.rows(n), specs)

    # ----------------------------------------------------------------- counters

    def mem_counters(self) -> MemCounters:
        if self.ledger is None:
            return MemCounters(cells_total=0, cells_used=0, allocated_bytes=len(self._len) * self.desc.cell_bytes)
        used = self.ledger.used
        return MemCounters(cells_total=self.ledger.total, cells_used=used, allocated_bytes=used * self.desc.cell_bytes)

    def cells_released(self, seqs: Sequence[int]) -> int:
        return 0 if self.ledger is None else self.ledger.released(seqs)

    def sync_steps(self, on: bool) -> None:
        """llama_decode returns when its outputs are ready on CPU: steps are synchronous."""

    def vocabulary(self) -> Vocabulary:
        if self._vocab is None:
            self._vocab = self.tokenizer.vocabulary()
        return self._vocab

    def is_eos(self, token: int) -> bool:
        return token in self._eos

    def pos_max(self, seq: int) -> int:
        """llama.cpp's own last position of seq (-1: empty); for cross-checks."""
        return L.llama_memory_seq_pos_max(self._mem, seq)
