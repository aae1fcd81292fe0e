"""What transformers users reach for on a tokenizer, over the few things each of ours has
(``encode``, ``decode``, ``token_bytes``, ``eos_ids``, ``bos_id``, ``vocab_size``,
``chat_template``), and the chat template rendered in a jinja2 sandbox.

``TokenizerAPI`` is mixed into every tokenizer (ours, llama.cpp's, the toy's), so
``eos_token_id``, ``convert_ids_to_tokens`` and ``apply_chat_template(...,
continue_final_message=True)`` mean the same whichever runtime serves.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


class TokenizerAPI:
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    pad_id: int | None = None  # transformers' pad_token_id: None where the model names none
    _piece_ids: dict[str, int] | None = None

    # ------------------------------------------------------------ ids and pieces
    @property
    def eos_token_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    @property
    def bos_token_id(self) -> int | None:
        return self.bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self.pad_id

    @property
    def all_special_ids(self) -> list[int]:
        return sorted(self.special_ids)

    def __len__(self) -> int:
        return self.vocab_size

    def token_text(self, token_id: int) -> str:
        """A token's piece as the vocabulary spells it (byte-level "Ġ", sentencepiece "▁")."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        if isinstance(ids, int):
            return self.token_text(ids)
        skip = self.special_ids if skip_special_tokens else ()
        return [self.token_text(int(i)) for i in ids if int(i) not in skip]

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> int | None | list[int | None]:
        """A piece's id (None for one not in the vocabulary, where transformers gives unk)."""
        if self._piece_ids is None:
            self._piece_ids = {self.token_text(i): i for i in reversed(range(self.vocab_size))}
        if isinstance(tokens, str):
            return self._piece_ids.get(tokens)
        return [self._piece_ids.get(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        self.convert_tokens_to_ids("")
        return dict(self._piece_ids)

    # ------------------------------------------------------------ chat template
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, *,
                            continue_final_message: bool = False, chat_template: str | None = None,
                            tokenize: bool = False, **extra) -> str | list[int]:
        """The prompt text (``tokenize``: its ids), as transformers renders it. ``extra``
        are the template's variables (tools, enable_thinking, ...); ``chat_template``
        replaces the model's; ``continue_final_message`` ends the prompt inside the last
        message, so that the model continues it (no generation prompt then)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this model has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        extra = {k: v for k, v in extra.items() if k not in ("messages", "bos_token", "eos_token")}
        text = _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        if continue_final_message:
            text = _cut_after_final(text, messages)
        return self.encode(text) if tokenize else text


def _cut_after_final(text: str, messages: list[dict]) -> str:
    """The rendered chat up to the end of the last message's content (transformers' rule:
    its last occurrence, with the template's own trailing whitespace trimmed)."""
    final = messages[-1].get("content") if messages else None
    if isinstance(final, list):  # content parts: the last text part
        final = next((p.get("text") for p in reversed(final) if isinstance(p, dict) and "text" in p), None)
    if not isinstance(final, str) or not final.strip() or final.strip() not in text:
        raise ValueError("continue_final_message: the final message must have text that the chat template renders")
    at = text.rindex(final.strip())
    if text[at: at + len(final.lstrip())] == final.lstrip():
        return text[: at + len(final.lstrip())]
    return text[: at + len(final.strip())]


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v, indent=None, **kw: json.dumps(v, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
