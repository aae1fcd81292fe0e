"""A request's token rules in token ids: what the engine registers with the executor
(executor/token_rules.py applies them to each row).

``bad_words`` become token sequences as vLLM makes them: each word (left-stripped) is
tokenised alone and after a space, without special tokens; the spaced form is kept
when it starts with another token and has as many tokens (a word mid-text), so that a
word is banned at the start of the output and inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import ParamError, SamplingParams


@dataclass(frozen=True)
class RulesSpec:
    allowed: list[int] | None
    bad_words: list[list[int]]
    min_tokens: int
    min_ban: list[int]  # the stop ids and EOS ids; the executor adds its runtime's EOS


def bad_word_ids(tokenizer, words: tuple[str, ...]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise ParamError(f"bad_words: {word!r} has no tokens", "bad_words")
        out.append(list(bare))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(list(spaced))
    return out


def resolve(params: SamplingParams, tokenizer, eos_ids: frozenset[int]) -> RulesSpec | None:
    """The rules ``params`` asks for, None if it asks none. ParamError for a word with no tokens."""
    if not params.token_rules:
        return None
    allowed = None if params.allowed_token_ids is None else sorted(set(params.allowed_token_ids))
    ban = sorted(set(params.stop_token_ids) | set(eos_ids)) if params.min_tokens > 0 else []
    return RulesSpec(allowed, bad_word_ids(tokenizer, params.bad_words), params.min_tokens, ban)
