"""Tool calls out of generated text, as OpenAI deltas — streamed or whole.

``ToolCallStream.push(text)`` takes a choice's next text and answers the deltas it
makes final: ``{"content": ...}`` and ``{"tool_calls": [...]}`` in OpenAI's streaming
shape (the first delta of call k has ``index``, ``id``, ``type``, ``function.name`` and
empty arguments; later ones carry argument fragments). A whole response runs the very
same stream over the whole text (``whole``), so a streamed response reassembles to the
non-streamed one by construction.

Invariants:
- What went out is never taken back: content text that could still begin a call block
  (a prefix of ``<tool_call>``) is held back; an argument fragment is a slice of the
  call's argument text, which only grows.
- ``eager`` (output written under the tool grammar): a call is announced as soon as its
  name is complete and its arguments stream as they are written — the grammar makes
  them parse. Otherwise (``auto``: free text) a block becomes a call only once it is
  closed and parses as ``{"name": <a tool>, "arguments": <object>}``; a block that does
  not is content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .tools import CLOSE, OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class _Call:
    id: str
    name: str
    args: str  # the argument text so far
    complete: bool


def _args_end(text: str) -> int | None:
    """Where the JSON value at the start of ``text`` ends, or None if it has not yet."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and ch in ",}\n" and i > 0:
            return i  # a bare scalar ended
    return None


class ToolCallStream:
    def __init__(self, names: frozenset[str], eager: bool):
        self.names = names
        self.eager = eager
        self.text = ""
        self._content_sent = 0  # chars of content emitted, over all content items
        self._sent: list[_Call] = []  # calls announced, in order
        self.finished = False

    # ------------------------------------------------------------ reading the text
    def _items(self, final: bool) -> list[str | _Call]:
        """The text as content strings and calls, as far as it is settled: content that
        could still begin a block, and an open block that may still become a call, wait."""
        items: list[str | _Call] = []
        t, pos = self.text, 0
        while True:
            i = t.find(OPEN, pos)
            if i < 0:
                tail = t[pos:]
                if not final:
                    tail = tail[: len(tail) - _partial_open(tail)]
                items.append(tail)
                return items
            items.append(t[pos:i])
            j = t.find(CLOSE, i + len(OPEN))
            body = t[i + len(OPEN) : j if j >= 0 else len(t)]
            call = self._call(body, closed=j >= 0, final=final)
            if call is None and (j >= 0 or final):
                items.append(t[i : j + len(CLOSE) if j >= 0 else len(t)])  # not a call: content as written
            elif call is None:
                return items  # an open block that may still become a call
            else:
                items.append(call)
            if j < 0:
                return items
            pos = j + len(CLOSE)

    def _call(self, body: str, closed: bool, final: bool) -> _Call | None:
        if self.eager:
            m = _HEAD.match(body)
            if m is None:
                return None
            rest = body[m.end() :]
            end = _args_end(rest)
            return _Call("", json.loads(f'"{m.group(1)}"'), rest if end is None else rest[:end], end is not None)
        if not closed:
            return None
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or obj.get("name") not in self.names:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return _Call("", obj["name"], json.dumps(args, ensure_ascii=False), True)

    # ------------------------------------------------------------ deltas
    def push(self, text: str) -> list[dict]:
        self.text += text
        return self._deltas(final=False)

    def finish(self) -> list[dict]:
        self.finished = True
        return self._deltas(final=True)

    def _deltas(self, final: bool) -> list[dict]:
        items = self._items(final)
        out: list[dict] = []
        content = _content(items)
        if len(content) > self._content_sent:
            out.append({"content": content[self._content_sent :]})
            self._content_sent = len(content)
        calls = [x for x in items if isinstance(x, _Call)]
        for k, c in enumerate(calls):
            if k >= len(self._sent):
                c.id = f"call_{uuid.uuid4().hex[:24]}"
                self._sent.append(_Call(c.id, c.name, "", False))
                out.append({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                            "function": {"name": c.name, "arguments": ""}}]})
            sent = self._sent[k]
            if len(c.args) > len(sent.args):
                out.append({"tool_calls": [{"index": k, "function": {"arguments": c.args[len(sent.args) :]}}]})
                sent.args = c.args
            sent.complete = c.complete
        return out

    # ------------------------------------------------------------ the whole answer
    @property
    def calls(self) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.args}} for c in self._sent]

    @property
    def complete_calls(self) -> bool:
        return bool(self._sent) and all(c.complete for c in self._sent)


def _content(items: list) -> str:
    """Content items joined; whitespace between or after calls (the lines that separate
    blocks) is not content."""
    out, seen_call = [], False
    for x in items:
        if isinstance(x, _Call):
            seen_call = True
        elif x and (not seen_call or x.strip()):
            out.append(x)
    return "".join(out)


def _partial_open(tail: str) -> int:
    """How many trailing characters of ``tail`` could begin ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(tail)), 0, -1):
        if OPEN.startswith(tail[-n:]):
            return n
    return 0


def whole(names: frozenset[str], eager: bool, text: str) -> tuple[str | None, list[dict], bool]:
    """A whole response: (content or None, tool calls, whether every call is complete)."""
    s = ToolCallStream(names, eager)
    deltas = s.push(text) + s.finish()
    content = "".join(d.get("content", "") for d in deltas)
    return (content or None), s.calls, s.complete_calls
