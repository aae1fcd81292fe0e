"""Tokenizer: text <-> token ids, built with the ``tokenizers`` library from a GGUF file's
metadata (vocabulary, merges, token types, chat template) or a Hugging Face folder
(tokenizer.json + tokenizer_config.json).

Also what the engine needs around it: each token's raw bytes (incremental detokenizing,
grammars), EOS / special ids, and the chat template rendered in a jinja2 sandbox.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

from .models import ModelLoadError
from .tokenizer_api import TokenizerAPI
from .vocabulary import Vocabulary

# GGUF token types (llama.cpp): 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
UNKNOWN, CONTROL, USER_DEFINED, BYTE = 2, 3, 4, 6

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the splits llama.cpp applies before BPE, in order.
PRE_SPLITS: dict[str, list[str]] = {
    "default": [_GPT2], "gpt2": [_GPT2],
    "llama3": [_LLAMA3], "llama-v3": [_LLAMA3], "llama-bpe": [_LLAMA3], "smaug-bpe": [_LLAMA3], "dbrx": [_LLAMA3],
    "qwen2": [_QWEN2], "deepseek-r1-qwen": [_QWEN2],
    # digits one by one, then the GPT-2 split (SmolLM / StarCoder vocabularies)
    "smollm": [r"\p{N}", _GPT2], "starcoder": [r"\p{N}", _GPT2], "refact": [r"\p{N}", _GPT2],
}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable alphabet: character -> the byte it stands for."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a sentencepiece vocabulary: each token split into two known pieces,
    ordered by the token's score (best first), then by the pieces' ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for tok, score in zip(tokens, scores):
        for cut in range(1, len(tok)):
            a, b = tok[:cut], tok[cut:]
            if a in ids and b in ids:
                merges.append((-score, ids[a], ids[b], a, b))
    merges.sort()
    return [(a, b) for *_, a, b in merges]


def _gguf_fields(path: Path, reader):
    """``get(key, default)``: the contents of GGUF field ``tokenizer.<key>``, or ``default``
    when absent; a field that is present but unreadable is a ModelLoadError."""
    def get(key, default=None):
        f = reader.fields.get(f"tokenizer.{key}")
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:  # a corrupt string (bad UTF-8), a short array
            raise ModelLoadError(f"{path}: unreadable metadata field 'tokenizer.{key}' ({e})") from e

    return get


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    """GPT-2 style BPE over the printable byte alphabet, after the splits of ``PRE_SPLITS[pre]``."""
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                     fuse_unk=False, byte_fallback=False))
    splits = PRE_SPLITS.get(pre, [_GPT2])
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_bpe(tokens: list[str], pairs: list[tuple[str, str]], *, unk: int, space_prefix: bool) -> HFTokenizer:
    """A sentencepiece vocabulary as BPE with byte fallback: spaces become "▁"."""
    backend = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=pairs,
                                     unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
    # The "▁" dummy prefix goes before every text fragment (added tokens split the text
    # first): at the start, after each special token, and even before a leading space
    # (" Hi" -> "▁▁Hi"), as llama.cpp and sentencepiece do. transformers' gguf loader
    # (Metaspace, prepend_scheme="first") differs there; tests/test_gguf_types.py.
    steps = [normalizers.Replace(" ", "▁")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + ([decoders.Strip(" ", 1, 0)] if space_prefix else []))
    return backend


def _add_gguf_specials(backend: HFTokenizer, tokens: list[str], types: list[int], byte_level: bool) -> list[int]:
    """Register control / unknown tokens as special and user-defined ones as added; returns the special ids."""
    alphabet = set(_byte_decoder()) if byte_level else None
    # control and unknown tokens are special, as in llama.cpp: matched whole in text, dropped when decoding
    specials = [i for i, ty in enumerate(types)
                if ty in (CONTROL, UNKNOWN) and (alphabet is None or set(tokens[i]) <= alphabet)]
    backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False) for i in specials])
    user = [AddedToken(tokens[i], special=False, normalized=False) for i, ty in enumerate(types) if ty == USER_DEFINED]
    if user:
        backend.add_tokens(user)
    return specials


class Tokenizer(TokenizerAPI):
    def __init__(self, backend: HFTokenizer, *, eos_ids: list[int], bos_id: int | None, special_ids: set[int],
                 chat_template: str | None, byte_level: bool, add_bos: bool = False,
                 bos_token: str = "", eos_token: str = ""):
        self.backend = backend
        self.eos_ids = list(eos_ids)
        self.bos_id = bos_id
        self.special_ids = frozenset(special_ids)
        self.chat_template = chat_template
        self.byte_level = byte_level
        self.add_bos = add_bos
        self.bos_token, self.eos_token = bos_token, eos_token
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._bytes: list[bytes] | None = None

    # ---------------------------------------------------------------- builders

    @classmethod
    def from_gguf(cls, path: str | Path, reader=None) -> "Tokenizer":
        """``reader``: an open gguf.GGUFReader of the same file, to avoid parsing it twice."""
        from gguf import GGUFReader

        path = Path(path)
        if reader is None:
            try:
                reader = GGUFReader(path)
            except Exception as e:
                raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from e
        try:
            return cls._build_from_gguf(path, reader)
        except ModelLoadError:
            raise
        except Exception as e:  # corrupt metadata the builders trip over: still the file's fault
            raise ModelLoadError(f"{path}: unreadable tokenizer metadata ({type(e).__name__}: {e})") from e

    @classmethod
    def _build_from_gguf(cls, path: Path, reader) -> "Tokenizer":
        get = _gguf_fields(path, reader)
        kind, tokens = get("ggml.model"), get("ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{path}: missing metadata field 'tokenizer.ggml.tokens'")
        types = get("ggml.token_type") or [1] * len(tokens)
        merges = get("ggml.merges")
        if kind == "gpt2":
            if merges is None:
                raise ModelLoadError(f"{path}: missing metadata field 'tokenizer.ggml.merges'")
            backend = _byte_level_bpe(tokens, merges, get("ggml.pre", "default"))
        elif kind == "llama":
            scores = get("ggml.scores") or [0.0] * len(tokens)
            pairs = [tuple(m.split(" ", 1)) for m in merges] if merges else _spm_merges(tokens, scores)
            backend = _sentencepiece_bpe(tokens, pairs, unk=get("ggml.unknown_token_id", 0),
                                         space_prefix=get("ggml.add_space_prefix", True))
        else:
            raise ModelLoadError(f"{path}: unsupported tokenizer model {kind!r} (field tokenizer.ggml.model)")
        byte_level = kind == "gpt2"
        specials = _add_gguf_specials(backend, tokens, types, byte_level)
        eos = [get(k) for k in ("ggml.eos_token_id", "ggml.eot_token_id", "ggml.eom_token_id")]
        eos = list(dict.fromkeys(int(e) for e in eos if e is not None))
        bos = get("ggml.bos_token_id")
        return cls(backend, eos_ids=eos, bos_id=bos, special_ids=set(specials), chat_template=get("chat_template"),
                   byte_level=byte_level, add_bos=bool(get("ggml.add_bos_token", kind == "llama")),
                   bos_token=tokens[bos] if bos is not None else "", eos_token=tokens[eos[0]] if eos else "")

    @classmethod
    def from_hf(cls, folder: str | Path) -> "Tokenizer":
        folder = Path(folder)
        file = folder / "tokenizer.json"
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as e:
            raise ModelLoadError(f"{file}: unreadable tokenizer ({e})") from e
        conf = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")

        def tok_text(v):
            return v.get("content") if isinstance(v, dict) else v

        eos_tok, bos_tok = tok_text(conf.get("eos_token")), tok_text(conf.get("bos_token"))
        eos = gen.get("eos_token_id")
        eos = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
        if eos_tok and backend.token_to_id(eos_tok) is not None:
            eos.append(backend.token_to_id(eos_tok))
        added = json.loads(backend.to_str()).get("added_tokens", [])
        model = json.loads(backend.to_str()).get("model", {})
        template = conf.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(backend, eos_ids=list(dict.fromkeys(eos)),
                   bos_id=backend.token_to_id(bos_tok) if bos_tok else None,
                   special_ids={a["id"] for a in added if a.get("special")}, chat_template=template,
                   byte_level=not model.get("byte_fallback", False), add_bos=bool(conf.get("add_bos_token", False)),
                   bos_token=bos_tok or "", eos_token=eos_tok or "")

    # ------------------------------------------------------------------- text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id) or ""

    def token_bytes(self, token_id: int) -> bytes:
        """A token's bytes; none for an id past the tokenizer's table: a model's embedding is
        often padded beyond its tokenizer (Qwen3: 151,936 rows, 151,669 tokens), and a sampled
        padding id renders as nothing (as llama.cpp does) instead of failing the request."""
        if self._bytes is None:
            self._bytes = self._all_bytes()
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def _all_bytes(self) -> list[bytes]:
        table = _byte_decoder()
        out = []
        for i in range(self.vocab_size):
            piece = self.backend.id_to_token(i)
            if piece is None:
                out.append(b"")
            elif i in self.special_ids:
                out.append(piece.encode("utf-8"))
            elif self.byte_level:
                out.append(bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode())
            elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("▁", " ").encode("utf-8"))
        return out

    def vocabulary(self) -> Vocabulary:
        tokens = [self.token_bytes(i) for i in range(self.vocab_size)]
        specials = sorted((self.backend.id_to_token(i), i) for i in self.special_ids)
        return Vocabulary(tokens=tokens, eos=list(self.eos_ids), specials=specials)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: unreadable ({e})") from e
