"""Our tokenizer (built from GGUF metadata with `tokenizers`) against transformers'
tokenizer loaded from the same GGUF file."""

from __future__ import annotations

import pytest

from superfluid.models import resolve_model
from superfluid.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world",
    "In 2024 there were 123 cats, 4567 dogs and 3.14159 pies.",
    "  leading spaces,\ttabs\n\nand blank lines\r\n",
    "héllo wörld — naïve café, Ærøskøbing, Straße",
    "日本語のテキストと中文文本，还有한국어 텍스트",
    "emoji 🤗🚀👩‍👩‍👧 and symbols ∑∫√∞ ≠ ≤",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(3)]}  # comment",
    "don't you'll I'm they've WE'D",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "<repo_name>x<file_sep>y<|endoftext|>",
    "Ελληνικά, русский текст, עברית, العربية",
    "",
]


@pytest.fixture(scope="module")
def ours():
    return Tokenizer.from_gguf(resolve_model())


@pytest.fixture(scope="module")
def theirs():
    from hf_reference import default_tokenizer

    return default_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_parity(ours, theirs, text):
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert b"".join(ours.token_bytes(i) for i in ids) == text.encode("utf-8")


def test_chat_template(ours, theirs):
    chats = [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi ✨"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    ]
    for msgs in chats:
        for gen in (True, False):
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == theirs.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen)


def test_specials_and_vocabulary(ours, theirs):
    assert ours.eos_ids == [2] and ours.bos_id == 1
    assert ours.vocab_size == len(theirs) == 49152
    assert {0, 1, 2} <= ours.special_ids
    v = ours.vocabulary()
    assert len(v.tokens) == ours.vocab_size and v.eos == [2]
    assert ("<|im_end|>", 2) in v.specials
    assert v.tokens[theirs.convert_tokens_to_ids("Ġthe")] == b" the"
    assert ours.encode("hi", add_special_tokens=True) == theirs.encode("hi", add_special_tokens=True)


def test_sandboxed_template(ours):
    evil = Tokenizer(ours.backend, eos_ids=[2], bos_id=1, special_ids=set(), byte_level=True,
                     chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    from jinja2.exceptions import SecurityError

    with pytest.raises(SecurityError):
        evil.apply_chat_template([{"role": "user", "content": "x"}])


def test_an_id_past_the_tokenizer_renders_as_nothing(ours):
    """A model's embedding is often padded beyond its tokenizer; a sampled padding id is no
    text (and no error) in the detokenizer the engine streams with."""
    from superfluid.engine.detokenizer import Detokenizer

    V = ours.vocab_size
    assert ours.token_bytes(V) == b"" and ours.token_bytes(V + 40) == b"" and ours.token_bytes(V - 1) != b""
    d = Detokenizer(ours)
    hello = ours.encode("Hello")
    assert "".join(d.push(t) for t in [*hello, V + 3]) == "Hello"
