"""Token rules: row masks that follow what a lane generated (vLLM's ``allowed_token_ids``,
``bad_words`` and ``min_tokens``), registered once per request like a logit bias.

Invariants:
- A rule only ever sets logits to -inf, so it commutes with the grammar mask and comes
  before the logit bias and the penalties (vLLM applies them as logits processors first).
- "Generated" means the lane's output: ``committed[out_start:]``, where ``out_start`` is
  the prompt's length less its decode replay, so a lane re-admitted after preemption or a
  crash (its output replayed as prompt) counts and matches exactly as it did.
- ``min_tokens``: the ids in ``min_ban`` (EOS and the stop ids) are banned while fewer
  than ``min_tokens`` tokens were generated.
- ``bad_words``: each is a token sequence; its last token is banned when the tokens
  generated just before match the rest (a one-token word is always banned).
- Every rule is pure numpy over the row; the bad words loop over words, never tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

MAX_ALLOWED = 1 << 17  # allowed ids per request (a large vocabulary, whole)
MAX_BAD_WORDS = 256  # token sequences per request (each word tokenised two ways)
MAX_BAD_WORD_TOKENS = 1024  # tokens per sequence (a 256-character word, 4 bytes each)


@dataclass(frozen=True)
class TokenRules:
    allowed: np.ndarray | None  # bool [V]: may be picked; None: every token
    banned: np.ndarray  # int64 ids banned always (the one-token bad words)
    sequences: tuple[tuple[tuple[int, ...], int], ...]  # (prefix, last) of the longer bad words
    min_tokens: int
    min_ban: np.ndarray  # int64 ids banned while fewer than min_tokens were generated

    @classmethod
    def build(cls, vocab_size: int, allowed: Sequence[int] | None, bad_words: Sequence[Sequence[int]],
              min_tokens: int, min_ban: Sequence[int]) -> TokenRules:
        """ValueError for an id outside the vocabulary or a list past its cap."""
        if allowed is not None and not 0 < len(allowed) <= MAX_ALLOWED:
            raise ValueError(f"allowed_token_ids must name 1 to {MAX_ALLOWED} tokens")
        if len(bad_words) > MAX_BAD_WORDS or any(not 0 < len(w) <= MAX_BAD_WORD_TOKENS for w in bad_words):
            raise ValueError(f"at most {MAX_BAD_WORDS} bad word sequences of 1 to {MAX_BAD_WORD_TOKENS} tokens")
        ids = [t for w in bad_words for t in w] + list(allowed or ()) + list(min_ban)
        if any(not 0 <= int(t) < vocab_size for t in ids):
            raise ValueError(f"a token rule names a token outside the vocabulary (0..{vocab_size - 1})")
        mask = None
        if allowed is not None:
            mask = np.zeros(vocab_size, dtype=bool)
            mask[np.asarray(allowed, dtype=np.int64)] = True
        single = sorted({int(w[0]) for w in bad_words if len(w) == 1})
        longer = tuple((tuple(map(int, w[:-1])), int(w[-1])) for w in bad_words if len(w) > 1)
        return cls(mask, np.asarray(single, dtype=np.int64), longer, max(int(min_tokens), 0),
                   np.asarray(sorted(set(map(int, min_ban))), dtype=np.int64))

    def apply(self, row: np.ndarray, committed: Sequence[int], out_start: int) -> None:
        """row: float32 [V], changed in place; committed[out_start:] is the output so far."""
        if self.allowed is not None:
            row[~self.allowed] = -np.inf
        if self.banned.size:
            row[self.banned] = -np.inf
        generated = len(committed) - out_start
        if generated < self.min_tokens and self.min_ban.size:
            row[self.min_ban] = -np.inf
        for prefix, last in self.sequences:
            n = len(prefix)
            if n <= generated and tuple(committed[len(committed) - n:]) == prefix:
                row[last] = -np.inf
