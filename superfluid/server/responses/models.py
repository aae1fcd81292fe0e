"""The ``POST /v1/responses`` request, in OpenAI's shape.

Pydantic checks shapes, types and every numeric and size bound (a value past one is a 400
naming its field); ``input`` items are read by items.py, which names ``input.N...`` in its
400s; sampling ranges are checked once more by ``SamplingParams.validate`` through the chat
request this one becomes (request.py). Unknown fields are ignored, as OpenAI's API does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

MAX_ITEMS = 4096  # input items in one request
MAX_TOOLS = 128  # OpenAI's limit (tools.py checks it again for chat)
MAX_ID_CHARS = 128  # a response id
MAX_METADATA = 16  # OpenAI's bounds: 16 pairs, keys of 64 characters, values of 512
INT32_MAX = (1 << 31) - 1
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # vLLM's range, as the chat endpoint's seed
MAX_TIMEOUT_S = 7 * 24 * 3600.0

MetaKey = Annotated[str, Field(max_length=64)]
MetaValue = Annotated[str, Field(max_length=512)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class FunctionTool(_Lenient):
    """A Responses function tool: flat, not nested under ``function`` as in chat."""

    type: str = "function"  # any other type (web_search, file_search, ...) is a 400 naming it
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"] = "function"
    name: str = Field(max_length=64)


ToolChoice = Union[Literal["none", "auto", "required"], NamedFunction]


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = None


class ResponsesRequest(_Lenient):
    model: str
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_ITEMS)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    store: bool = True
    stream: bool = False
    background: bool = False  # run on after the answer (needs store); GET polls it or streams it
    metadata: dict[MetaKey, MetaValue] | None = Field(default=None, max_length=MAX_METADATA)
    previous_response_id: str | None = Field(default=None, max_length=MAX_ID_CHARS)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # accepted; a prompt past the context is a 400
    # extras, as the chat endpoint has them
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    ignore_eos: bool = False
    priority: int = Field(default=0, ge=-(1 << 31), le=INT32_MAX)
    timeout: float | None = Field(default=None, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
