"""Grammar-constrained decoding over a runtime's vocabulary, with xgrammar.

Invariants:
- Every reference is a handle. ``compile`` hands its caller (the owner) a grammar
  handle; ``borrow`` hands a lane a separate *lane handle* (``LaneGrammar.handle``) that
  names the same grammar. ``release(h)`` drops exactly the reference ``h`` names, so the
  owner releasing never looks like a lane retiring, and the reverse. Handles of both
  kinds come from one counter and never repeat.
- ``available(grammar handle)`` is true while the owner's reference is held; lanes that
  borrowed keep decoding after the owner released. The compiled grammar is dropped from
  the store when its last reference goes (xgrammar's compiler cache, bounded by
  ``CACHE_BYTES``, may keep a copy so that a resent schema compiles at once).
- The vocabulary xgrammar sees is ``vocab_size`` long: ids past ``len(vocab.tokens)``,
  specials and stop tokens have empty text there, so a grammar never matches them as
  text; xgrammar marks empty tokens special (never allowed) and allows the stop tokens
  only where the grammar can end.
- ``cursor`` changes no state of the store: it only builds a fresh matcher.
- Compiling runs in a bounded pool of threads (xgrammar releases the GIL), never on the
  caller's loop: ``compile(wait=False)`` answers a handle at once, and ``states`` says
  when it is ready. A compile still running ``COMPILE_BUDGET_S`` after it was asked for
  fails, and its source is refused at once from then on (``_refused``, by hash): an
  expensive schema costs one budget, once, and is never retried. A runaway compile
  keeps its pool thread until xgrammar returns (threads cannot be killed); the pool is
  small, so such compiles queue and time out instead of piling up.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import os
import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import xgrammar as xgr

from ..runtimes.base import Vocabulary

KINDS = ("json_schema", "json_object", "regex", "ebnf")
CACHE_BYTES = 64 << 20  # xgrammar's compiled-grammar cache across handles
# xgrammar's own threads within one compile: half the cores, at most 8 (on 2 cores 8 threads
# made a cheap schema wait 59 s behind a runaway one; 1 thread: 0.25 s)
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
COMPILE_POOL = 2  # compiles at once
COMPILE_BUDGET_S = 5.0  # from the request to a compiled grammar
MAX_REFUSED = 4096  # sources remembered as too expensive
PENDING, READY, FAILED = 0, 1, 2  # a grammar handle's state (``states``)


from .grammar_errors import GrammarError, GrammarOverflow  # noqa: E402  (re-exported)


class Cursor:
    """A matcher's position in one compiled grammar: what a lane decodes through."""

    def __init__(self, grammar: int, compiled: xgr.CompiledGrammar, stop: np.ndarray):
        self.grammar = grammar  # the grammar handle it was made from
        self._matcher = xgr.GrammarMatcher(compiled)
        self._stop = stop  # bool [V]: the stop tokens
        self._bitmask = xgr.allocate_token_bitmask(1, stop.shape[0])  # int32 [1, ceil(V/32)]
        self._fresh = False  # _bitmask holds the mask of the matcher's current state
        self.borrowed = False

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        if self._matcher.is_terminated():
            raise GrammarOverflow("the grammar has ended (a stop token was accepted)")
        if not self._fresh:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._fresh = True
        # Token j is bit j % 32 of word j // 32; read as little-endian bytes, that is
        # bit j of the byte string, lowest bit first.
        words = self._bitmask.numpy()[0].astype("<i4", copy=False)
        bits = np.unpackbits(words.view(np.uint8), bitorder="little", count=self._stop.shape[0])
        return bits.view(bool)

    def mask(self, row: np.ndarray) -> None:
        """row: float32 [V] logits; every token not allowed next becomes -inf, in place."""
        allowed = self.allowed()
        if not allowed.any():
            raise GrammarOverflow("no token of the vocabulary can continue the grammar")
        np.copyto(row, -np.inf, where=~allowed)

    def accept(self, token: int) -> bool:
        """Advance over ``token``. True when the output is complete and only a stop
        token could follow (or a stop token was just accepted)."""
        m, token = self._matcher, int(token)
        if m.is_terminated():
            raise GrammarOverflow(f"token {token} after the grammar ended")
        if not 0 <= token < self._stop.shape[0] or not m.accept_token(token):
            raise GrammarOverflow(f"token {token} is not allowed by the grammar here")
        self._fresh = False
        if m.is_terminated():
            return True
        if not m.is_completed():
            return False
        # Complete, but it may go on (a regex's trailing [0-9]+): done only if nothing
        # but a stop token is allowed. The mask is kept for the next mask() call.
        return not (self.allowed() & ~self._stop).any()

    def done(self) -> bool:
        """The grammar has accepted a stop token; nothing more can follow."""
        return self._matcher.is_terminated()


@dataclass(eq=False)
class LaneGrammar:
    """A lane's borrowed cursor. ``handle`` is the lane's own reference: the lane drops
    it with ``store.release(lane_grammar.handle)``; ``grammar`` is the grammar handle."""

    handle: int
    grammar: int
    cursor: Cursor

    def mask(self, row: np.ndarray) -> None:
        self.cursor.mask(row)

    def accept(self, token: int) -> bool:
        return self.cursor.accept(token)


@dataclass(eq=False)
class _Entry:
    future: Future  # -> xgr.CompiledGrammar, or GrammarError
    key: bytes  # the source's hash
    asked: float  # time.monotonic() when compiling was asked for
    owned: bool = True  # the owner's reference (from compile) is held
    lanes: set[int] = field(default_factory=set)  # lane handles that borrowed it
    error: str | None = None  # set once it failed (or ran past the budget)

    @property
    def compiled(self) -> xgr.CompiledGrammar:
        return self.future.result()


class GrammarStore:
    """Compiled grammars by handle, over one runtime's vocabulary."""

    def __init__(self, vocab: Vocabulary, vocab_size: int):
        if len(vocab.tokens) > vocab_size:
            raise ValueError(f"{len(vocab.tokens)} tokens do not fit vocab_size {vocab_size}")
        stops = sorted({t for t in vocab.eos if 0 <= t < vocab_size})
        # Empty text for every id a grammar must never match as text (see the invariants).
        text = list(vocab.tokens) + [b""] * (vocab_size - len(vocab.tokens))
        for tok in stops + [tok for _, tok in vocab.specials if 0 <= tok < vocab_size]:
            text[tok] = b""
        info = xgr.TokenizerInfo(
            text, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stops
        )
        self.vocab_size = vocab_size
        self._stop = np.zeros(vocab_size, dtype=bool)
        self._stop[stops] = True
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=COMPILE_THREADS, cache_limit_bytes=CACHE_BYTES
        )
        self._grammars: dict[int, _Entry] = {}  # grammar handle -> entry
        self._pool = ThreadPoolExecutor(COMPILE_POOL, thread_name_prefix="grammar-compile")
        self._refused: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # hash -> why
        self.budget_s = COMPILE_BUDGET_S
        self._lanes: dict[int, int] = {}  # lane handle -> grammar handle
        self._ids = itertools.count(1)

    # ------------------------------------------------------------ owner side

    def compile(self, kind: str, source: str | None = None, wait: bool = True) -> int:
        """A grammar handle. ``wait``: compile now (GrammarError if it fails or runs past
        the budget); else the compile runs in the pool and ``states`` tells its end."""
        key = hashlib.blake2b(f"{kind}\0{source}".encode(), digest_size=16).digest()
        if key in self._refused:
            raise GrammarError(self._refused[key])
        _check_source(kind, source)
        handle = next(self._ids)
        entry = self._grammars[handle] = _Entry(self._pool.submit(self._compile, kind, source), key, time.monotonic())
        if wait:
            state, message = self._settle(entry, block=True)
            if state == FAILED:
                del self._grammars[handle]
                raise GrammarError(message)
        return handle

    def states(self, handles: list[int]) -> list[tuple[int, str]]:
        """(PENDING | READY | FAILED, the failure's message) for each grammar handle."""
        out = []
        for h in handles:
            entry = self._grammars.get(h)
            out.append((FAILED, f"grammar handle {h} is not live") if entry is None else self._settle(entry))
        return out

    def _settle(self, entry: _Entry, block: bool = False) -> tuple[int, str]:
        if entry.error is None and not entry.future.done():
            left = entry.asked + self.budget_s - time.monotonic()
            if block and left > 0:
                try:
                    entry.future.exception(timeout=left)
                except TimeoutError:
                    pass
            if not entry.future.done():
                if time.monotonic() - entry.asked < self.budget_s:
                    return PENDING, ""
                entry.error = f"compiling the grammar took longer than {self.budget_s:g} s; it is refused"
                self._refused[entry.key] = entry.error
                while len(self._refused) > MAX_REFUSED:
                    self._refused.popitem(last=False)
        if entry.error is None and entry.future.exception() is not None:
            entry.error = str(entry.future.exception())
        return (FAILED, entry.error) if entry.error is not None else (READY, "")

    def release(self, handle: int) -> None:
        """Drop the one reference ``handle`` names (an owner's or a lane's)."""
        if handle in self._lanes:
            grammar = self._lanes.pop(handle)
            entry = self._grammars[grammar]
            entry.lanes.discard(handle)
        else:
            entry = self._grammars.get(handle)
            if entry is None or not entry.owned:
                raise KeyError(f"grammar handle {handle} is not held")
            grammar, entry.owned = handle, False
        if not entry.owned and not entry.lanes:
            del self._grammars[grammar]

    def available(self, handle: int) -> bool:
        entry = self._grammars.get(handle)
        return entry is not None and entry.owned and self._settle(entry)[0] == READY

    def handles(self) -> dict[int, int]:
        """Live grammar handle -> references held (owner + lanes)."""
        return {h: int(e.owned) + len(e.lanes) for h, e in self._grammars.items()}

    # ------------------------------------------------------------- lane side

    def cursor(self, handle: int, replay: list[int]) -> Cursor | None:
        """A fresh cursor advanced over ``replay``; None if the grammar rejects it."""
        cursor = Cursor(handle, self._entry(handle).compiled, self._stop)
        for token in replay:
            try:
                cursor.accept(int(token))
            except GrammarOverflow:
                return None
        return cursor

    def borrow(self, handle: int, cursor: Cursor) -> LaneGrammar:
        entry = self._entry(handle)
        if cursor.grammar != handle or cursor.borrowed:
            raise ValueError(f"cursor is not a fresh cursor of grammar {handle}")
        cursor.borrowed = True
        lane = next(self._ids)
        entry.lanes.add(lane)
        self._lanes[lane] = handle
        return LaneGrammar(lane, handle, cursor)

    # --------------------------------------------------------------- helpers

    def _entry(self, handle: int) -> _Entry:
        entry = self._grammars.get(handle)
        if entry is None:
            raise KeyError(f"grammar handle {handle} is not live")
        return entry

    def _compile(self, kind: str, source: str | None) -> xgr.CompiledGrammar:
        """In a pool thread: the source was checked by ``_check_source``."""
        if kind == "json_object":
            # Any object: an object schema that allows every property.
            return self._compiler.compile_json_schema('{"type": "object"}', strict_mode=False)
        try:
            if kind == "json_schema":
                return self._compiler.compile_json_schema(source)
            if kind == "regex":
                return self._compiler.compile_regex(source)
            return self._compiler.compile_grammar(source)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"invalid {kind}: {_clean(str(e))}") from None


def _check_source(kind: str, source: str | None) -> None:
    """What can be refused at once, before a compile is started."""
    if kind not in KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r} (one of {', '.join(KINDS)})")
    if kind == "json_object":
        return
    if not isinstance(source, str) or not source.strip():
        raise GrammarError(f"{kind} needs a source text")
    if kind == "json_schema":
        _check_schema(source)


def _check_schema(source: str) -> None:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid json_schema: not JSON ({e})") from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("invalid json_schema: a schema is a JSON object or a boolean")


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def _clean(message: str) -> str:
    """xgrammar's C++ error text without its log prefix, on one line."""
    return " ".join(_LOG_PREFIX.sub("", message.strip()).split())
