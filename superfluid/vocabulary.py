"""``Vocabulary``: each token id's raw bytes, EOS and special ids (a leaf).

The tokenizer builds it and runtimes, grammars and penalties read it, so it lives below
both: ``tokenizer.py`` never imports ``runtimes/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Vocabulary:
    """What grammars and penalties need of the tokenizer."""

    tokens: list[bytes]  # each id's raw bytes as it appears in text
    eos: list[int] = field(default_factory=list)
    specials: list[tuple[str, int]] = field(default_factory=list)
