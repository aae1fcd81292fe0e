"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes.

/tokenize takes a ``prompt`` (text, tokenized as /v1/completions does) or ``messages``
(rendered through the chat template exactly as /v1/chat/completions renders them,
tools included) and answers ``{"count", "max_model_len", "tokens"}`` (plus
``token_strs`` when asked). /detokenize takes ``tokens`` and answers ``{"prompt"}``.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import Field, model_validator

from ..engine.params import ParamError
from ..engine.serving import ServingEngine
from .errors import APIError
from .messages import template_messages, total_chars
from .protocol import ChatMessage, TokenId, _Lenient
from .tool_models import Tool, ToolChoice
from .tools import plan_tools, render_chat


MAX_DETOKENIZE = 1 << 18  # tokens in one /detokenize body


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    # the file's BOS where its tokenizer asks for one; default as the endpoints tokenize:
    # true for a prompt (completions), false for messages (the chat template writes its own)
    add_special_tokens: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=MAX_DETOKENIZE)


def install(app: FastAPI, engine: ServingEngine, name: str, check_chars) -> None:
    tokenizer = engine.tokenizer

    def check_model(requested: str | None) -> None:
        if requested is not None and requested != name:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")

    # Plain functions: FastAPI runs them in its thread pool, so rendering and tokenising a
    # long text never holds up the event loop that feeds every stream.
    @app.post("/tokenize")
    def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if body.prompt is not None:
            check_chars(len(body.prompt), "prompt")
            text = body.prompt
        else:
            if not body.messages:
                raise APIError(400, "messages must not be empty", "messages", "invalid_value")
            try:
                messages = template_messages(body.messages)
                plan = plan_tools(body.tools, body.tool_choice, True, False)
            except ParamError as e:
                raise APIError(400, str(e), e.param, "invalid_value") from None
            check_chars(total_chars(messages), "messages")
            try:
                text = render_chat(tokenizer, messages, plan, body.add_generation_prompt)
            except Exception as e:
                raise APIError(400, f"the chat template rejected the messages: {e}", "messages", "invalid_value") from None
        special = body.add_special_tokens if body.add_special_tokens is not None else body.prompt is not None
        ids = tokenizer.encode(text, add_special_tokens=special)
        out = {"count": len(ids), "max_model_len": engine.max_seq_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
        return out

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (0..{engine.vocab_size - 1})", "tokens",
                           "invalid_value")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}
