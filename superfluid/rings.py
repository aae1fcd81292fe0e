"""Token and logits rings: spans of memory that plans and events refer to.

Three rings, each with a single writer:
- ``PROMPTS`` (ring 0): the scheduler writes prompt tokens, the executor reads them.
- ``EMITS``   (ring 1): the executor writes emitted tokens, the scheduler reads them.
- ``LOGITS``  (ring 2): the executor writes host lanes' rows, the scheduler reads them.

A writer opens a batch with ``begin()`` (the scheduler before building a plan, the
executor before writing a tick's output): the ring rewinds and its generation goes up,
so every reference from an earlier batch is stale. A reference is checked against the
ring's generation (``RingError.STALE``) and its bounds (``RingError.BOUNDS``). A write
that does not fit raises ``RingFull``.

The buffers are numpy arrays; ``SharedRings`` (worker process) backs them with shared
memory, and the latency/yield flags with a shared byte each.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from .abi import RingRef

PROMPTS, EMITS, LOGITS = 0, 1, 2


class RingError(Exception):
    class Kind(IntEnum):
        STALE = 1
        UNKNOWN_RING = 2
        BOUNDS = 3

    def __init__(self, kind: "RingError.Kind"):
        super().__init__(kind.name)
        self.kind = kind


class RingFull(Exception):
    pass


class Ring:
    """A span allocator over one flat buffer. ``generation`` counts batches."""

    def __init__(self, buf: np.ndarray, ring_id: int, row: int = 1, meta: np.ndarray | None = None):
        self.buf = buf  # [capacity] tokens, or [capacity * row] floats
        self.ring_id = ring_id
        self.row = row  # elements per unit (1 for tokens, vocab for logits rows)
        # meta[0]: generation, meta[1]: head (in units); shared memory in a worker
        self.meta = meta if meta is not None else np.zeros(2, dtype=np.int64)

    @property
    def capacity(self) -> int:
        return self.buf.shape[0] // self.row

    @property
    def generation(self) -> int:
        return int(self.meta[0])

    def begin(self) -> None:
        self.meta[0] += 1
        self.meta[1] = 0

    def write(self, values: np.ndarray) -> RingRef:
        n = values.shape[0] // self.row
        head = int(self.meta[1])
        if head + n > self.capacity:
            raise RingFull(f"ring {self.ring_id}: {n} units do not fit ({head}/{self.capacity} used)")
        self.buf[head * self.row : (head + n) * self.row] = values
        self.meta[1] = head + n
        return RingRef(ring=self.ring_id, offset=head, length=n, generation=self.generation)

    def read(self, ref: RingRef) -> np.ndarray:
        if ref.generation != self.generation:
            raise RingError(RingError.Kind.STALE)
        if ref.offset < 0 or ref.length < 0 or ref.offset + ref.length > int(self.meta[1]):
            raise RingError(RingError.Kind.BOUNDS)
        return self.buf[ref.offset * self.row : (ref.offset + ref.length) * self.row]


class Rings:
    """The three rings and the two signals the scheduler raises for a running tick."""

    def __init__(self, vocab_size: int, token_capacity: int = 1 << 20, logits_rows: int = 256):
        self.vocab_size = vocab_size
        self.rings = {
            PROMPTS: Ring(np.zeros(token_capacity, dtype=np.uint32), PROMPTS),
            EMITS: Ring(np.zeros(token_capacity, dtype=np.uint32), EMITS),
            LOGITS: Ring(np.zeros(logits_rows * vocab_size, dtype=np.float32), LOGITS, row=vocab_size),
        }
        self._flags = np.zeros(2, dtype=np.uint8)  # [latency_wanted, yield_requested]

    def _ring(self, ref: RingRef) -> Ring:
        ring = self.rings.get(ref.ring)
        if ring is None:
            raise RingError(RingError.Kind.UNKNOWN_RING)
        return ring

    # ---- the scheduler's side
    def begin_prompts(self) -> None:
        self.rings[PROMPTS].begin()

    def write_prompt(self, tokens) -> RingRef:
        return self.rings[PROMPTS].write(np.asarray(tokens, dtype=np.uint32))

    def read_emits(self, ref: RingRef) -> list[int]:
        if ref.length == 0:
            return []
        return self._ring(ref).read(ref).tolist()

    def read_logits_row(self, ref: RingRef) -> np.ndarray:
        return self._ring(ref).read(ref).copy()

    def set_latency_wanted(self, on: bool) -> None:
        self._flags[0] = 1 if on else 0

    def request_yield(self, on: bool = True) -> None:
        self._flags[1] = 1 if on else 0

    # ---- the executor's side
    def read_tokens(self, ref: RingRef) -> list[int]:
        return self._ring(ref).read(ref).tolist()

    def begin_output(self) -> None:
        self.rings[EMITS].begin()
        self.rings[LOGITS].begin()

    def write_tokens(self, tokens: list[int]) -> RingRef:
        return self.rings[EMITS].write(np.asarray(tokens, dtype=np.uint32))

    def write_logits_row(self, row: np.ndarray) -> RingRef:
        return self.rings[LOGITS].write(np.asarray(row, dtype=np.float32).reshape(-1))

    def latency_wanted(self) -> bool:
        return bool(self._flags[0])

    def yield_requested(self) -> bool:
        return bool(self._flags[1])
