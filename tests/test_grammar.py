"""Grammar-constrained decoding: drive cursors the way a decoder does and check the text."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from superfluid.executor.grammar import GrammarError, GrammarOverflow, GrammarStore
from superfluid.runtimes.base import Vocabulary

# ---------------------------------------------------------------- vocabulary

EOS, BOS = 0, 1
PIECES = ['{"', '":', '",', '"}', "true", "false", "null", "12", "abc", "ing", ", ", "\n\n", "é"]
TOKENS = [b"</s>", b"<s>"]  # specials carry text that a grammar must never match
TOKENS += [chr(c).encode() for c in range(32, 127)] + [b"\n"]
TOKENS += [p.encode() for p in PIECES]
TOKENS += [b"\xc3", b"\xa9"]  # 'é' split in two: tokens need not be whole characters
V = 256  # ids past len(TOKENS) are unusable padding
VOCAB = Vocabulary(tokens=TOKENS, eos=[EOS], specials=[("</s>", EOS), ("<s>", BOS)])
TID = {t: i for i, t in enumerate(TOKENS) if i > BOS}

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
REGEX = r"[a-c]{3}-[0-9]+"
EBNF = r"""
root ::= "(" item ("," item)* ")"
item ::= [a-z]+ | root
"""


def valid_schema_text(text: str) -> bool:
    obj = json.loads(text)
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "age", "color"}
        and isinstance(obj["name"], str)
        and type(obj["age"]) is int
        and obj["color"] in ("red", "green", "blue")
    )


def valid_ebnf_text(text: str) -> bool:
    pos = 0

    def group() -> bool:
        nonlocal pos
        if text[pos : pos + 1] != "(":
            return False
        pos += 1
        while True:
            if text[pos : pos + 1] == "(":
                if not group():
                    return False
            else:
                m = re.match(r"[a-z]+", text[pos:])
                if not m:
                    return False
                pos += m.end()
            if text[pos : pos + 1] == ")":
                pos += 1
                return True
            if text[pos : pos + 1] != ",":
                return False
            pos += 1

    return group() and pos == len(text)


VALID = {
    "json_schema": valid_schema_text,
    "json_object": lambda text: isinstance(json.loads(text), dict),
    "regex": lambda text: re.fullmatch(REGEX, text) is not None,
    "ebnf": valid_ebnf_text,
}
SOURCES = {"json_schema": json.dumps(SCHEMA), "json_object": None, "regex": REGEX, "ebnf": EBNF}

STORE = GrammarStore(VOCAB, V)
HANDLES = {kind: STORE.compile(kind, src) for kind, src in SOURCES.items()}  # held for the module

# Tokens that close what is open; preferred once a walk is long, so walks end.
CLOSERS = [EOS] + [TID[t] for t in (b'"}', b'"', b"}", b"]", b")")]


# ------------------------------------------------------------------- decoder


def row_at(seed: int, step: int) -> np.ndarray:
    """The logits row of one step: a function of (seed, step) only, as a replayed lane sees."""
    return np.random.default_rng([seed, step]).standard_normal(V).astype(np.float32)


def decode(lane, seed: int, *, start: int = 0, pick: str = "argmax", patience: int = 40):
    """Mask, pick, accept until done; returns (tokens, how it ended)."""
    tokens = []
    for step in range(start, start + 2000):
        row = row_at(seed, step)
        lane.mask(row)
        allowed = np.isfinite(row)
        assert not allowed[BOS] and not allowed[len(TOKENS) :].any()
        if step >= patience and allowed[CLOSERS].any():
            tok = next(t for t in CLOSERS if allowed[t])
        elif pick == "argmax":
            tok = int(np.argmax(row))
        else:
            ids = np.flatnonzero(allowed)
            tok = int(ids[np.random.default_rng([seed, step, 1]).integers(len(ids))])
        done = lane.accept(tok)
        if tok == EOS:
            assert done
            return tokens, "eos"
        tokens.append(tok)
        if done:
            # Nothing but a stop token may follow a finished grammar.
            row = row_at(seed, step + 1)
            lane.mask(row)
            assert np.flatnonzero(np.isfinite(row)).tolist() == [EOS]
            return tokens, "grammar"
    raise AssertionError("walk did not end")


def text(tokens) -> str:
    return b"".join(TOKENS[t] for t in tokens).decode()


def run(kind: str, seed: int, pick: str = "argmax"):
    lane = STORE.borrow(HANDLES[kind], STORE.cursor(HANDLES[kind], []))
    try:
        return decode(lane, seed, pick=pick)
    finally:
        STORE.release(lane.handle)


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("kind", list(SOURCES))
@pytest.mark.parametrize("pick", ["argmax", "random"])
def test_walks_yield_valid_text(kind, pick):
    for seed in range(3):
        tokens, how = run(kind, seed, pick)
        assert VALID[kind](text(tokens)), text(tokens)
        if kind in ("json_schema", "json_object", "ebnf"):
            assert how == "grammar"  # the closing brace / paren ends it, no EOS needed


def test_regex_ends_only_by_eos():
    # After "abc-1" more digits may follow: accept() is not done, EOS becomes allowed.
    lane = STORE.borrow(HANDLES["regex"], STORE.cursor(HANDLES["regex"], []))
    row = np.zeros(V, np.float32)
    lane.mask(row)
    assert not np.isfinite(row[EOS])
    for ch in b"abc-1":
        assert lane.accept(TID[bytes([ch])]) is False
    row = np.zeros(V, np.float32)
    lane.mask(row)
    assert np.isfinite(row[EOS]) and np.isfinite(row[TID[b"7"]]) and not np.isfinite(row[TID[b"a"]])
    assert lane.accept(EOS) is True
    with pytest.raises(GrammarOverflow):
        lane.mask(row)
    with pytest.raises(GrammarOverflow):
        lane.accept(TID[b"7"])
    STORE.release(lane.handle)


def test_multibyte_tokens():
    h = STORE.compile("regex", "(é|e)+x")
    for pieces in ([b"\xc3", b"\xa9", b"x"], [b"\xc3\xa9", b"e", b"x"]):
        c = STORE.cursor(h, [TID[p] for p in pieces])
        assert c is not None
        row = np.zeros(V, np.float32)
        c.mask(row)
        assert np.flatnonzero(np.isfinite(row)).tolist() == [EOS]
    # Half a character cannot be followed by another character's start.
    assert STORE.cursor(h, [TID[b"\xc3"], TID[b"\xc3"]]) is None
    STORE.release(h)


@pytest.mark.parametrize(
    "kind,source,words",
    [
        ("json_schema", "{not json", "not JSON"),
        ("json_schema", '{"type": "objec"}', "objec"),
        ("json_schema", "[1, 2]", "object"),
        ("regex", "[a-", "'['"),
        ("ebnf", "root ::= foo", "foo"),
        ("ebnf", "root ::= (", "ebnf"),
        ("yaml", "a: b", "unknown grammar kind"),
        ("regex", None, "needs a source"),
    ],
)
def test_invalid_sources_raise_grammar_error(kind, source, words):
    before = STORE.handles()
    with pytest.raises(GrammarError) as err:
        STORE.compile(kind, source)
    assert words in str(err.value) and "/project/" not in str(err.value)
    assert STORE.handles() == before


def test_rejected_token_raises_overflow():
    lane = STORE.borrow(HANDLES["json_schema"], STORE.cursor(HANDLES["json_schema"], []))
    with pytest.raises(GrammarOverflow):
        lane.accept(TID[b"}"])
    with pytest.raises(GrammarOverflow):
        lane.accept(BOS)  # a special is never allowed
    with pytest.raises(GrammarOverflow):
        lane.accept(EOS)  # nor a stop before the grammar can end
    with pytest.raises(GrammarOverflow):
        lane.accept(V + 3)
    assert lane.accept(TID[b'{"']) is False  # the failed accepts changed nothing
    STORE.release(lane.handle)


def test_overflow_when_the_vocabulary_cannot_continue():
    # No token starts with the bytes of '日': after "a" the mask may allow only more "a"
    # (xgrammar masks token by token; it does not look ahead for an unspellable end).
    h = STORE.compile("regex", "a+日")
    c = STORE.cursor(h, [TID[b"a"]])
    row = np.zeros(V, np.float32)
    c.mask(row)
    assert np.flatnonzero(np.isfinite(row)).tolist() == [TID[b"a"]]
    STORE.release(h)
    h = STORE.compile("regex", "日")
    with pytest.raises(GrammarOverflow):
        STORE.cursor(h, []).mask(np.zeros(V, np.float32))
    STORE.release(h)


@pytest.mark.parametrize("kind", list(SOURCES))
def test_replay_continues_to_the_same_output(kind):
    seed = 7
    full, how = run(kind, seed)
    for cut in sorted({0, 1, len(full) // 2, len(full) - 1}):
        cursor = STORE.cursor(HANDLES[kind], full[:cut])
        assert cursor is not None
        lane = STORE.borrow(HANDLES[kind], cursor)
        rest, how2 = decode(lane, seed, start=cut)
        STORE.release(lane.handle)
        assert full[:cut] + rest == full and how2 == how


def test_invalid_replay_returns_none_and_changes_nothing():
    h = HANDLES["json_schema"]
    before = STORE.handles()
    assert STORE.cursor(h, [TID[b"}"]]) is None
    assert STORE.cursor(h, [TID[b"{"], BOS]) is None
    assert STORE.cursor(h, [TID[b"{"], V + 1]) is None
    assert STORE.cursor(h, [TID[b"{"], -1]) is None
    ok = STORE.cursor(h, [TID[b'{"'], TID[b"n"]])
    assert ok is not None and not ok.done()
    assert STORE.handles() == before


def test_reference_counting():
    store = GrammarStore(VOCAB, V)
    h = store.compile("regex", REGEX)
    assert store.available(h) and store.handles() == {h: 1}
    lane = store.borrow(h, store.cursor(h, []))
    assert lane.grammar == h and lane.handle != h and store.handles() == {h: 2}
    with pytest.raises(ValueError):
        store.borrow(h, lane.cursor)  # one cursor, one lane

    store.release(h)  # the owner lets go: no new lanes, the borrowing lane goes on
    assert not store.available(h) and store.handles() == {h: 1}
    for ch in b"abc-4":
        lane.accept(TID[bytes([ch])])
    row = np.zeros(V, np.float32)
    lane.mask(row)
    assert np.isfinite(row[EOS])
    with pytest.raises(KeyError):
        store.release(h)  # the owner's reference is gone already

    store.release(lane.handle)  # the last reference: the grammar goes
    assert store.handles() == {}
    with pytest.raises(KeyError):
        store.cursor(h, [])
    with pytest.raises(KeyError):
        store.release(lane.handle)

    # A lane retiring first leaves the owner's reference (and availability) alone.
    h2 = store.compile("regex", REGEX)  # xgrammar's cache makes this one quick
    assert h2 not in (h, lane.handle)
    lane2 = store.borrow(h2, store.cursor(h2, []))
    store.release(lane2.handle)
    assert store.available(h2) and store.handles() == {h2: 1}
    store.release(h2)
    assert not store.available(h2) and store.handles() == {}


def test_padding_and_specials_never_allowed_and_vocab_checks():
    with pytest.raises(ValueError):
        GrammarStore(VOCAB, len(TOKENS) - 1)
    # The specials' own text ("<s>") must not satisfy a grammar that spells it.
    h = STORE.compile("regex", "<s>|</s>")
    c = STORE.cursor(h, [])
    row = np.zeros(V, np.float32)
    c.mask(row)
    assert not np.isfinite(row[[EOS, BOS]]).any() and np.isfinite(row[TID[b"<"]])
    STORE.release(h)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(list(SOURCES)),
    seed=st.integers(0, 2**32 - 1),
    pick=st.sampled_from(["argmax", "random"]),
    patience=st.integers(0, 60),
)
def test_random_walks_are_grammar_valid(kind, seed, pick, patience):
    lane = STORE.borrow(HANDLES[kind], STORE.cursor(HANDLES[kind], []))
    try:
        tokens, _ = decode(lane, seed, pick=pick, patience=patience)
    finally:
        STORE.release(lane.handle)
    assert VALID[kind](text(tokens)), text(tokens)
