"""The tokenizer of a GGUF for the llamacpp runtime.

Our own ``Tokenizer.from_gguf`` (HF tokenizers, checked against transformers) covers the
BPE and sentencepiece vocabularies whose pre-tokenizer it knows. Every other vocabulary
llama.cpp loads (another pre-tokenizer, RWKV, T5/UGM, PLaMo, ...) is tokenized by
llama.cpp itself: ``LlamaCppTokenizer`` loads the file's vocabulary only (no weights) and
answers the same interface through ``llama_tokenize`` / ``llama_detokenize`` /
``llama_token_to_piece``; the chat template is the file's, rendered by the same jinja
sandbox as ours.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as L

from ...models import ModelLoadError
from ...tokenizer import PRE_SPLITS, Tokenizer
from ...tokenizer_api import TokenizerAPI
from ..base import Vocabulary
from .lib import init_backend, recent_errors


def ours_can(path: Path) -> bool:
    """Whether our tokenizer tokenizes this file exactly as llama.cpp does."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception:
        return True  # ours reports the unreadable file, naming it
    f = reader.fields

    def get(key):
        x = f.get(key)
        return None if x is None else x.contents()

    kind = get("tokenizer.ggml.model")
    if kind == "llama":
        return True
    return kind == "gpt2" and (get("tokenizer.ggml.pre") or "default") in PRE_SPLITS


def gguf_tokenizer(path: Path):
    return Tokenizer.from_gguf(path) if ours_can(path) else LlamaCppTokenizer(path)


class LlamaCppTokenizer(TokenizerAPI):
    byte_level = False

    def __init__(self, path: Path):
        init_backend()
        params = L.llama_model_default_params()
        params.vocab_only = True
        params.n_gpu_layers = 0
        self._model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ModelLoadError(f"{path}: llama.cpp cannot load its vocabulary ({recent_errors() or 'no reason given'})")
        self._vocab = L.llama_model_get_vocab(self._model)
        v = self._vocab
        self.vocab_size = L.llama_vocab_n_tokens(v)
        attrs = [L.llama_vocab_get_attr(v, i) for i in range(self.vocab_size)]
        special = L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN
        self.special_ids = frozenset(i for i, a in enumerate(attrs) if a & special)
        self.eos_ids = [i for i in range(self.vocab_size) if L.llama_vocab_is_eog(v, i)]
        eos = L.llama_vocab_eos(v)
        if eos in self.eos_ids:  # the EOS first, as ours lists it
            self.eos_ids.remove(eos)
            self.eos_ids.insert(0, eos)
        bos = L.llama_vocab_bos(v)
        self.bos_id = bos if bos >= 0 else None
        self.add_bos = bool(L.llama_vocab_get_add_bos(v))
        tmpl = L.llama_model_chat_template(self._model, None)
        self.chat_template = tmpl.decode("utf-8") if tmpl else None
        self.bos_token = self._text(self.bos_id)
        self.eos_token = self._text(self.eos_ids[0] if self.eos_ids else None)
        self._bytes: list[bytes] | None = None

    def _text(self, token: int | None) -> str:
        return "" if token is None else L.llama_vocab_get_text(self._vocab, token).decode("utf-8", "replace")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special_tokens and self.add_bos, True)
        if n < 0:  # the buffer was short: -n tokens
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special_tokens and self.add_bos, True)
        return list(buf[:n])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        # Specials are dropped here, not by llama_detokenize's remove_special (which drops
        # only an added BOS/EOS, and then keeps the sentencepiece space after that BOS).
        ids = [i for i in ids if not (skip_special_tokens and i in self.special_ids)]
        if not ids:
            return ""
        toks = (L.llama_token * len(ids))(*ids)
        cap = 8 * len(ids) + 16
        while True:
            out = ctypes.create_string_buffer(cap)
            n = L.llama_detokenize(self._vocab, toks, len(ids), out, cap, False, not skip_special_tokens)
            if n >= 0:
                return out.raw[:n].decode("utf-8", "replace")
            cap = -n + 1

    def token_bytes(self, token_id: int) -> bytes:
        if self._bytes is None:
            self._bytes = [self._piece(i) for i in range(self.vocab_size)]
        return self._bytes[token_id]

    def _piece(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = L.llama_token_to_piece(self._vocab, token, buf, 64, 0, True)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = L.llama_token_to_piece(self._vocab, token, buf, -n, 0, True)
        return buf.raw[:n]

    def vocabulary(self) -> Vocabulary:
        tokens = [self.token_bytes(i) for i in range(self.vocab_size)]
        specials = sorted((self._text(i), i) for i in self.special_ids)
        return Vocabulary(tokens=tokens, eos=list(self.eos_ids), specials=specials)

    def token_text(self, token_id: int) -> str:
        return self._text(token_id)

    def __del__(self):
        try:
            if self._model:
                L.llama_model_free(self._model)
                self._model = None
        except Exception:
            pass
