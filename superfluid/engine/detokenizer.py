"""Incremental detokenization on token bytes.

Invariant: the text handed out is always whole UTF-8 characters. A token may end
in the middle of a multi-byte character (byte-level BPE splits emoji and CJK
across tokens); those bytes wait in the incremental decoder until the character
completes. Bytes that can never form a character become U+FFFD, exactly as
``bytes.decode("utf-8", errors="replace")`` of the whole output would, so the
concatenation of every delta equals decoding all the bytes at once.

Working on bytes rather than re-decoding a sliding window of token ids keeps the
cost per token O(token length) and makes the result independent of how tokens
were grouped into ticks.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenBytes(Protocol):
    special_ids: frozenset[int] | set[int]

    def token_bytes(self, token_id: int) -> bytes: ...


class Detokenizer:
    def __init__(self, tokenizer: TokenBytes, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = frozenset(tokenizer.special_ids) if skip_special_tokens else frozenset()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """The text this token completes (possibly empty)."""
        if token_id in self._skip:
            return ""
        return self._decoder.decode(self._tok.token_bytes(token_id), final=False)

    def flush(self) -> str:
        """At the end of a generation: whatever bytes still wait, as U+FFFD."""
        return self._decoder.decode(b"", final=True)

    @property
    def pending_bytes(self) -> int:
        return len(self._decoder.getstate()[0])


def decode_all(tokenizer: TokenBytes, ids, skip_special_tokens: bool = True) -> str:
    d = Detokenizer(tokenizer, skip_special_tokens)
    return "".join(d.push(t) for t in ids) + d.flush()
