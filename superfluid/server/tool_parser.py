"""Tool calls out of generated text, as OpenAI deltas — streamed or whole.

``open_stream(plan)`` gives a choice's stream: ``push(text)`` takes the choice's next
text and answers the deltas it makes final: ``{"content": ...}`` and
``{"tool_calls": [...]}`` in OpenAI's streaming shape (the first delta of call k has
``index``, ``id``, ``type``, ``function.name`` and empty arguments; later ones carry
argument fragments). A whole response runs the very same stream over the whole text
(``whole``), so a streamed response reassembles to the non-streamed one by construction.

Two streams:
- ``AutoStream`` (``auto``: free text): the family's parser (toolcalls/) finds call
  regions; a region becomes calls once it has ended and every call in it is a call of a
  listed tool whose arguments follow its schema (toolcalls/validate.py); else it is content,
  as the model wrote it. With ``parallel_tool_calls: false`` only the first call is kept.
- ``ForcedStream`` (written under the tool grammar): call 0 is announced as soon as its
  name is whole and its arguments stream as they are written — the grammar makes them
  parse and validate (in Qwen3-Coder's XML and pythonic syntax the arguments are not JSON
  as written: each call goes out whole once it is complete). A later call goes out once
  it is complete, so that a call the ``max_tokens`` ceiling cuts short never went out: it
  is dropped, and the calls before it are the answer (``finish_reason`` ``tool_calls``).

Invariants: what went out is never taken back (content that could still begin a call is
held back by the parser; an argument fragment only extends its call's arguments). Work per
push is proportional to the new text. Whitespace-only content before the first call,
between calls or after the last is not content (the lines that separate blocks).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .toolcalls.forced import ForcedReader
from .toolcalls.forced_native import NATIVE, native_reader
from .toolcalls.registry import PARSERS
from .toolcalls.scan import Found
from .toolcalls.validate import ToolSchemas
from .tools import ToolPlan


@dataclass
class _Call:
    id: str
    name: str
    args: list[str] = field(default_factory=list)  # the argument text, in the pieces it came in
    complete: bool = False


class _Calls:
    """The calls announced so far, and the deltas that announce and extend them."""

    def __init__(self):
        self.sent: list[_Call] = []

    def announce(self, name: str, out: list[dict]) -> _Call:
        c = _Call(f"call_{uuid.uuid4().hex[:24]}", name)
        out.append({"tool_calls": [{"index": len(self.sent), "id": c.id, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        self.sent.append(c)
        return c

    def extend(self, frag: str, out: list[dict]) -> None:
        """More argument text of the last call announced."""
        if frag:
            self.sent[-1].args.append(frag)
            out.append({"tool_calls": [{"index": len(self.sent) - 1, "function": {"arguments": frag}}]})

    @property
    def calls(self) -> list[dict]:
        return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": "".join(c.args)}}
                for c in self.sent]

    @property
    def complete_calls(self) -> bool:
        return bool(self.sent) and all(c.complete for c in self.sent)


class AutoStream(_Calls):
    def __init__(self, plan: ToolPlan):
        super().__init__()
        self.schemas = ToolSchemas(plan.functions)
        self.parser = PARSERS[plan.syntax](self.schemas.params)
        self.parallel = plan.parallel
        self.forced = False
        self._ws = ""  # whitespace held back: it is content only if more content follows
        self._started = False  # content other than whitespace went out before any call

    def push(self, text: str) -> list[dict]:
        return self._deltas([it for piece in _slices(text) for it in self.parser.feed(piece, final=False)])

    def finish(self) -> list[dict]:
        out = self._deltas(self.parser.feed("", final=True))
        if self._ws and not self.sent:  # all there is, whitespace: content after all
            out.append({"content": self._ws})
        self._ws = ""
        return out

    def _deltas(self, items: list) -> list[dict]:
        out: list[dict] = []
        for it in items:
            if isinstance(it, Found):
                calls = [(name, self.schemas.arguments(name, args)) for name, args in it.calls]
                if all(a is not None for _, a in calls):
                    self._ws = ""
                    for name, args in calls[: None if self.parallel else max(0, 1 - len(self.sent))]:
                        self.announce(name, out).complete = True
                        self.extend(args, out)
                    continue
                it = it.raw  # not a call: content, as written
            self._content(it, out)
        return _merged(out)

    def _content(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        if self._started and not self.sent:  # plain content, no call yet: as it comes
            out.append({"content": text})
            return
        s = self._ws + text
        body = s.rstrip() if self.sent else s  # after a call, trailing whitespace waits
        if not body.strip():
            self._ws = s
            return
        self._started, self._ws = True, s[len(body):]
        out.append({"content": body})


def _merged(out: list[dict]) -> list[dict]:
    """Adjacent content deltas as one (joined once: a push may hold many pieces)."""
    merged: list[dict] = []
    run: list[str] = []
    for d in out + [{}]:
        if "content" in d:
            run.append(d["content"])
            continue
        if run:
            merged.append({"content": "".join(run)})
            run = []
        if d:
            merged.append(d)
    return merged


class ForcedStream(_Calls):
    def __init__(self, plan: ToolPlan):
        super().__init__()
        syntax = plan.forced_syntax
        self.reader = native_reader(syntax, ToolSchemas(plan.functions)) if syntax in NATIVE else ForcedReader()
        self.forced = True
        self._held: _Call | None = None  # a later call, until it is complete
        self._held_args: list[str] = []

    def push(self, text: str) -> list[dict]:
        out: list[dict] = []
        for ev in (ev for piece in _slices(text) for ev in self.reader.feed(piece)):
            if ev[0] == "call":
                if not self.sent:
                    self.announce(ev[1], out)
                else:
                    self._held, self._held_args = _Call("", ev[1]), []
            elif ev[0] == "args":
                if self._held is not None:
                    self._held_args.append(ev[1])
                else:
                    self.extend(ev[1], out)
            elif self._held is not None:  # a later call is complete: out it goes, whole
                self.announce(self._held.name, out).complete = True
                self.extend("".join(self._held_args), out)
                self._held = None
            else:
                self.sent[-1].complete = True
        return out

    def finish(self) -> list[dict]:
        self._held = None  # cut short by the ceiling: never sent, dropped
        return []


def _slices(text: str, size: int = 4096) -> list[str]:
    """A long text in pieces: the parsers slice what follows a region off what they were
    given, so one push of a whole response would cost its length per region."""
    return [text[i : i + size] for i in range(0, len(text), size)]


def open_stream(plan: ToolPlan) -> AutoStream | ForcedStream:
    return ForcedStream(plan) if plan.constrained else AutoStream(plan)


def finish_reason(stream: AutoStream | ForcedStream, reason: str | None) -> str | None:
    """The choice's finish reason: ``tool_calls`` when it ended on complete calls; under
    the grammar also when ``max_tokens`` cut a later call short (it was dropped)."""
    if stream.complete_calls and (reason == "stop" or (stream.forced and reason == "length")):
        return "tool_calls"
    return reason


def whole(plan: ToolPlan, text: str) -> tuple[str | None, list[dict], bool]:
    """A whole response: (content or None, tool calls, whether every call is complete)."""
    s = open_stream(plan)
    deltas = s.push(text) + s.finish()
    content = "".join(d.get("content", "") for d in deltas)
    return (content or None), s.calls, s.complete_calls
