"""Rings in one shared-memory segment, so plans and events carry only references.

Layout (all little-endian, 8-byte aligned):
  meta   int64[3, 2]   per ring: generation, head
  flags  int64[2]      latency_wanted, yield_requested
  prompts uint32[token_capacity], emits uint32[token_capacity], logits float32[rows * vocab]
The engine creates the segment and owns it; a worker attaches by name and never
unlinks it, so a restarted worker finds the same rings.
"""

from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np

from ..rings import EMITS, LOGITS, PROMPTS, Ring, Rings


def _attach(name: str | None, size: int) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name, create=name is None, size=size)
    if name is not None:
        # Python registers attached segments with its resource tracker, which would
        # unlink them when this (worker) process exits; the engine owns them.
        try:
            from multiprocessing import resource_tracker

            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:
            pass
    return shm


class Pulse:
    """Two counters the worker bumps: [0] heartbeat (a thread), [1] completed runtime calls."""

    def __init__(self, name: str | None = None):
        self.owner = name is None
        self.shm = _attach(name, 16)
        self.name = self.shm.name
        self.counts = np.ndarray((2,), dtype=np.int64, buffer=self.shm.buf)
        if self.owner:
            self.counts[:] = 0

    def close(self) -> None:
        self.counts = None  # type: ignore[assignment]
        self.shm.close()
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def _layout(vocab_size: int, token_capacity: int, logits_rows: int) -> tuple[list[tuple[str, object, int]], int]:
    parts = [
        ("meta", np.int64, 6),
        ("flags", np.int64, 2),
        ("prompts", np.uint32, token_capacity),
        ("emits", np.uint32, token_capacity),
        ("logits", np.float32, logits_rows * vocab_size),
    ]
    out, at = [], 0
    for name, dtype, n in parts:
        out.append((name, dtype, at))
        at += n * np.dtype(dtype).itemsize
        at = (at + 7) // 8 * 8
    return out, at


class SharedRings(Rings):
    def __init__(self, vocab_size: int, token_capacity: int = 1 << 20, logits_rows: int = 256, name: str | None = None):
        layout, size = _layout(vocab_size, token_capacity, logits_rows)
        self.owner = name is None
        self.shm = _attach(name, size)
        counts = {"meta": 6, "flags": 2, "prompts": token_capacity, "emits": token_capacity,
                  "logits": logits_rows * vocab_size}
        views = {
            name: np.ndarray((counts[name],), dtype=dtype, buffer=self.shm.buf, offset=off) for name, dtype, off in layout
        }
        if self.owner:
            views["meta"][:] = 0
            views["flags"][:] = 0
        meta = views["meta"].reshape(3, 2)
        self.vocab_size = vocab_size
        self.spec = (vocab_size, token_capacity, logits_rows, self.shm.name)
        self.rings = {
            PROMPTS: Ring(views["prompts"], PROMPTS, meta=meta[0]),
            EMITS: Ring(views["emits"], EMITS, meta=meta[1]),
            LOGITS: Ring(views["logits"], LOGITS, row=vocab_size, meta=meta[2]),
        }
        self._flags = views["flags"]

    @classmethod
    def attach(cls, spec: tuple[int, int, int, str]) -> "SharedRings":
        vocab_size, token_capacity, logits_rows, name = spec
        return cls(vocab_size, token_capacity, logits_rows, name=name)

    def close(self) -> None:
        # drop numpy views first: the buffer cannot close while they exist
        self.rings = {}
        self._flags = None  # type: ignore[assignment]
        try:
            self.shm.close()
        except BufferError:
            return
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass
