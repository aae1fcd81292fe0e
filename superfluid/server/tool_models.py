"""OpenAI's tool shapes in requests: function tools, tool_choice, assistant tool calls.

Pydantic checks the shapes (a wrong one is pydantic's 400 naming the field); what a
shape means — names, schemas, the choice against the tools — is checked in tools.py.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class CalledFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string; a dict is accepted too


class AssistantToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction = Field(...)
