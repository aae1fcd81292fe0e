"""The tool-call parsers by name, and which one a chat template speaks.

``superfluid serve --tool-call-parser auto|NAME``: ``auto`` reads the model's chat
template for each family's markers; a template without tool syntax is prompted with this
server's fallback, which asks for Hermes' blocks; a template with tool syntax but no
marker we know gets Hermes' too (the most common syntax).
"""

from __future__ import annotations

from dataclasses import dataclass

from .granite import TOOL_CALL, Granite
from .hermes import OPEN, Hermes
from .llama3 import PYTHON_TAG, Llama3Json
from .mistral import ARGS, CALL_ID, TOOL_CALLS, Mistral
from .pythonic import PYTHON_END, PYTHON_START, Pythonic
from .qwen3_xml import Qwen3Xml
from .scan import Scanner

PARSERS: dict[str, type[Scanner]] = {
    "hermes": Hermes,
    "llama3_json": Llama3Json,
    "mistral": Mistral,
    "qwen3_coder": Qwen3Xml,
    "pythonic": Pythonic,
    "granite": Granite,
}

# the marker text each family's parser must see: where the model's vocabulary has it as a
# special token, requests that parse calls decode with special tokens kept
MARKERS = {
    "hermes": (OPEN, "</tool_call>"),
    "llama3_json": (PYTHON_TAG,),
    "mistral": (TOOL_CALLS, ARGS, CALL_ID),
    "qwen3_coder": (OPEN, "</tool_call>"),
    "pythonic": (PYTHON_START, PYTHON_END),
    "granite": (TOOL_CALL,),
}

# (family, markers that all appear in its templates), the first that matches wins:
# Qwen3-Coder's templates also have Hermes' <tool_call>, so they come first
_SIGNS = (
    ("mistral", ("[TOOL_CALLS]",)),
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("hermes", ("<tool_call>",)),
    ("granite", ("<|tool_call|>",)),
    ("pythonic", ("<|python_start|>",)),
    ("pythonic", ("func_name1(",)),  # the pythonic templates' instruction: [func_name1(params_name1=...)]
    ("llama3_json", ("<|python_tag|>",)),
    ("llama3_json", ('{"name": function name',)),  # Llama 3.2's JSON instruction
)


def has_tool_syntax(template: str | None) -> bool:
    return bool(template) and "tools" in template


def detect(template: str | None) -> str:
    """The family a chat template's tool syntax is written in."""
    if not has_tool_syntax(template):
        return "hermes"  # the fallback prompt's blocks
    for family, signs in _SIGNS:
        if all(s in template for s in signs):
            return family
    return "hermes"


def select(name: str, template: str | None) -> str:
    if name == "auto":
        return detect(template)
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; one of: auto, {', '.join(PARSERS)}")
    return name


@dataclass(frozen=True)
class ToolSyntax:
    """The server's tool-call syntax: its family, and whether requests that parse calls
    decode with special tokens kept (a marker of the family is one in this vocabulary)."""

    family: str = "hermes"
    keep_specials: bool = False


def resolve(name: str, tokenizer) -> ToolSyntax:
    family = select(name, tokenizer.chat_template)
    return ToolSyntax(family, any(_is_special(tokenizer, m) for m in MARKERS[family]))


def _is_special(tokenizer, marker: str) -> bool:
    ids = tokenizer.encode(marker, add_special_tokens=False)
    return len(ids) == 1 and ids[0] in tokenizer.special_ids
