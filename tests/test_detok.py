"""Incremental detokenization never splits a UTF-8 character."""

from hypothesis import given, settings
from hypothesis import strategies as st

from superfluid.engine.detokenizer import Detokenizer, decode_all


class ByteTokenizer:
    """Token i is an arbitrary byte string from a table: enough to split characters anywhere."""

    def __init__(self, pieces: list[bytes], specials=()):
        self.pieces = pieces
        self.special_ids = set(specials)

    def token_bytes(self, i: int) -> bytes:
        return self.pieces[i]


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(cuts, cuts[1:]) if b > a]


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_deltas_are_whole_characters_and_add_up(text, cuts):
    pieces = _split(text.encode(), cuts)
    tok = ByteTokenizer(pieces)
    d = Detokenizer(tok)
    out = []
    for i in range(len(pieces)):
        delta = d.push(i)
        assert "\ufffd" not in delta  # valid input never produces a replacement char
        delta.encode("utf-8")  # a str of whole characters (no lone surrogates)
        out.append(delta)
    out.append(d.flush())
    assert "".join(out) == text


def test_emoji_split_across_three_tokens_is_held_back():
    data = "a😀b".encode()  # the emoji is 4 bytes
    tok = ByteTokenizer([data[:2], data[2:4], data[4:]])
    d = Detokenizer(tok)
    assert d.push(0) == "a"
    assert d.pending_bytes == 1
    assert d.push(1) == ""
    assert d.push(2) == "😀b"
    assert d.flush() == ""


def test_invalid_bytes_become_replacement_like_a_whole_decode():
    pieces = [b"ok", b"\xff", b"\xe6\x97", b"x"]  # a stray byte, then a truncated CJK char
    tok = ByteTokenizer(pieces)
    whole = b"".join(pieces).decode("utf-8", errors="replace")
    assert decode_all(tok, range(4)) == whole


def test_special_tokens_are_skipped_unless_asked():
    tok = ByteTokenizer([b"<s>", b"hi"], specials={0})
    assert decode_all(tok, [0, 1]) == "hi"
    assert decode_all(tok, [0, 1], skip_special_tokens=False) == "<s>hi"


def test_toy_tokenizer_multibyte_pieces():
    from superfluid.runtimes.toy_vocab import ToyTokenizer

    tok = ToyTokenizer()
    ids = tok.encode("prix: 5€ 日本 café")
    assert decode_all(tok, ids) == "prix: 5€ 日本 café" == tok.decode(ids)
