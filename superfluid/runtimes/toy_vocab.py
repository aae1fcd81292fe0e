"""The toy runtime's vocabulary and a tokenizer over it.

Ids 0-2 are specials (EOS, BOS, a tool marker); then every printable ASCII
character; then a few multi-character pieces, so that grammars and detokenization
meet tokens longer than one character.
"""

from __future__ import annotations

from ..tokenizer_api import TokenizerAPI
from .base import Vocabulary

EOS, BOS, TOOL = 0, 1, 2
SPECIALS = [("</s>", EOS), ("<s>", BOS), ("<|tool|>", TOOL)]
_PIECES = [
    '{"', '":', '",', '"}', "true", "false", "null", " the", "ing", "ed", "er", " a",
    "\n\n", "  ", "th", "he", "in", "an", "re", "on", "é", "日本", "€", ", ",
    "ab", "ba", "abc", "cab", " and", " to", " of",
]


def toy_pieces(vocab_size: int) -> list[bytes]:
    """Each id's raw bytes; ids past the defined pieces are unused (empty)."""
    pieces = [name.encode() for name, _ in SPECIALS]
    pieces += [chr(c).encode() for c in range(32, 127)]
    pieces.append(b"\n")
    pieces += [p.encode() for p in _PIECES]
    if vocab_size < len(pieces):
        raise ValueError(f"the toy vocabulary needs at least {len(pieces)} ids")
    return pieces + [b""] * (vocab_size - len(pieces))


def toy_vocabulary(vocab_size: int) -> Vocabulary:
    return Vocabulary(tokens=toy_pieces(vocab_size), eos=[EOS], specials=list(SPECIALS))


class ToyTokenizer(TokenizerAPI):
    """Greedy longest-match over the toy pieces; the same interface as ``superfluid.tokenizer``."""

    chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )

    def __init__(self, vocab_size: int = 160):
        self.vocab_size = vocab_size
        self._pieces = toy_pieces(vocab_size)
        self._by_bytes = {p: i for i, p in enumerate(self._pieces) if p and i not in self.special_ids}
        self._longest = max(len(p) for p in self._by_bytes)
        self.eos_ids = [EOS]
        self.bos_id = BOS
        self.add_bos = False  # as the default model's file: add_special_tokens adds no BOS

    @property
    def special_ids(self) -> set[int]:
        return {i for _, i in SPECIALS}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data = text.encode()
        out = [BOS] if add_special_tokens and self.add_bos else []
        i = 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                tid = self._by_bytes.get(data[i : i + n])
                if tid is not None:
                    out.append(tid)
                    i += n
                    break
            else:  # a byte no piece covers: the tool marker stands in (never in tests' text)
                out.append(ord("?") - 32 + 3)
                i += 1
        return out

    def token_bytes(self, token: int) -> bytes:
        return self._pieces[token] if 0 <= token < len(self._pieces) else b""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        skip = self.special_ids if skip_special_tokens else set()
        return b"".join(self.token_bytes(t) for t in ids if t not in skip).decode("utf-8", errors="replace")

    def vocabulary(self) -> Vocabulary:
        return toy_vocabulary(self.vocab_size)
