"""OpenAI request models and their translation into engine ``SamplingParams``.

Pydantic checks shapes and types; ranges are checked once, by
``SamplingParams.validate`` and ``Engine.validate``, so the Python API and the
server refuse the same things with the same messages. Unknown fields are ignored,
as OpenAI's API does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..abi import MAX_TOP_LOGPROBS
from ..engine.params import (
    INT32_MAX, MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, MAX_LOGIT_BIAS, MAX_N_CAP,
    MAX_STOP_TOKEN_IDS, MAX_TOKENS_CAP, MAX_TOP_K, PRIORITY_MAX, PRIORITY_MIN, SEED_MAX, SEED_MIN, ParamError,
    SamplingParams,
)
from . import structured
from .structured import Choices, GrammarText, StructuredOutputs
from .tool_models import AssistantToolCall, Tool, ToolChoice


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


# Every number is bounded here, where it enters, so that the OpenAPI schema states each
# bound (the fuzzer draws the values at and past them) and a value past one is pydantic's
# 400 naming its field. The ranges of sampling values are SamplingParams.validate's too
# (the Python API enters there); counts that depend on the server (n <= --max-n, token ids
# < the vocabulary) are checked against it by the engine.
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
MAX_PROMPTS = 256  # prompts in one completions request (each is its own engine request)
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_CHAT_TEMPLATE_CHARS = 1 << 17  # real templates are 1-20 KB; a request's is rendered only when trusted
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: every chunk carries the usage so far


class JsonSchemaFormat(_Lenient):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema", "regex"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None  # extension: type "regex"


class _Sampling(_Lenient):
    """Fields both endpoints share (OpenAI's, then the vLLM-style extras)."""

    model: str
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_TOKENS_CAP)  # 0: echo's score-only
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N_CAP)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extras
    top_k: int | None = Field(default=None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_regex: GrammarText | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_choice: Choices | None = None
    guided_grammar: GrammarText | None = None
    structured_outputs: StructuredOutputs | None = None
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_CAP)
    bad_words: Annotated[list[Annotated[str, Field(max_length=MAX_BAD_WORD_CHARS)]],
                         Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    priority: int = Field(default=0, ge=PRIORITY_MIN, le=PRIORITY_MAX)
    # extension: a wall-clock deadline, seconds (finite: NaN and infinity are refused)
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    prompt_cache_key: str | None = None  # requests sharing a key share protected cache entries (and a replica)
    prompt_cache_retention: str | None = None  # "in_memory" | "24h" (engine/cache_keys.py)


class CompletionRequest(_Sampling):
    prompt: Union[str, Annotated[list[str], Field(max_length=MAX_PROMPTS)], list[TokenId],
                  Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True  # the file's BOS before a text prompt, where its tokenizer asks for one
    best_of: int | None = Field(default=None, ge=1, le=MAX_N_CAP)


class ContentPart(_Lenient):
    type: str = "text"  # only "text" is served; others are a 400 naming them (messages.py)
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer"]  # anything else: 400 naming messages.N.role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # a tool result names the call it answers


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM: the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # vLLM: the tokenizer's special tokens (BOS) on top of the template's
    chat_template_kwargs: dict[str, Any] | None = None  # extra variables for the chat template
    chat_template: str | None = Field(default=None, max_length=MAX_CHAT_TEMPLATE_CHARS)  # vLLM: needs --trust-request-chat-template
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None  # accepted and ignored, as `user` is


# ------------------------------------------------------------------ translation


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for k, v in (raw or {}).items():
        try:
            out[int(k)] = float(v)
        except (TypeError, ValueError):
            raise ParamError(f"logit_bias keys must be token ids, got {k!r}", "logit_bias") from None
    return out


def _common(req: _Sampling, max_tokens: int | None, logprobs: int | None, default_max: int | None) -> SamplingParams:
    stop = req.stop if req.stop is not None else ()
    return SamplingParams(
        n=req.n,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        max_tokens=default_max if max_tokens is None else max_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        seed=req.seed,
        logprobs=logprobs,
        logit_bias=_logit_bias(req.logit_bias),
        grammar=structured.grammar(req),
        min_tokens=req.min_tokens,
        bad_words=tuple(req.bad_words or ()),
        allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
        skip_special_tokens=req.skip_special_tokens,
        priority=req.priority,
        prompt_cache_key=req.prompt_cache_key,
        prompt_cache_retention=req.prompt_cache_retention,
    )


def completion_params(req: CompletionRequest) -> SamplingParams:
    # best_of, echo and suffix: completion_extras.py
    if req.logprobs is not None and req.logprobs < 0:
        raise ParamError("logprobs must be non-negative", "logprobs")
    return _common(req, req.max_tokens, req.logprobs, default_max=16)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.top_logprobs is not None and not req.logprobs:
        raise ParamError("top_logprobs needs logprobs to be true", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs < 0:
        raise ParamError("top_logprobs must be non-negative", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return _common(req, max_tokens, logprobs, default_max=None)


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: a string, strings, token ids, lists of them."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise ParamError("the prompt is empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]
