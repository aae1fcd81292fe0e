"""One response being written: its output items and the typed events that write them.

The generated text goes through the chat endpoint's tool-call stream (tool_parser.py) when
the request has tools, else it is all message text; each of its deltas becomes events:

    content       -> (a new message item: output_item.added, content_part.added) output_text.delta
    a new call    -> (the open item closed) output_item.added of a function_call
    its arguments -> function_call_arguments.delta

and the end closes the open item (output_text.done + content_part.done, or
function_call_arguments.done; then output_item.done) before response.completed,
response.incomplete (max_output_tokens) or response.failed. A whole response runs the very
same build over the whole text, so a stream reassembles to it by construction.

Invariants: ``sequence_number`` counts every event of the response from 0; an item's
``output_index`` is its place in ``output`` and never changes.
"""

from __future__ import annotations

import copy
import uuid
from dataclasses import dataclass, field

from ...engine.outputs import ErrorCode
from ..render import Usage
from ..tool_parser import AutoStream, ForcedStream, finish_reason, open_stream
from ..tools import ToolPlan


def usage_body(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


@dataclass
class ResponseBuild:
    head: dict  # the response object's fields that do not change while it is written
    plan: ToolPlan | None
    output: list[dict] = field(default_factory=list)
    status: str = "in_progress"
    error: dict | None = None
    incomplete: dict | None = None
    usage: dict | None = None
    seq: int = 0
    _open: dict | None = None  # the item being written (the last of output)
    _parser: AutoStream | ForcedStream | None = None

    def __post_init__(self):
        if self.plan is not None and self.plan.parses:
            self._parser = open_stream(self.plan)

    @property
    def id(self) -> str:
        return self.head["id"]

    def snapshot(self) -> dict:
        return dict(self.head, status=self.status, error=self.error, incomplete_details=self.incomplete,
                    output=copy.deepcopy(self.output), usage=self.usage)

    def _event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    # ------------------------------------------------------------ writing
    def opening(self) -> list[dict]:
        return [self._event("response.created", response=self.snapshot()),
                self._event("response.in_progress", response=self.snapshot())]

    def push(self, text: str) -> list[dict]:
        if not text:
            return []
        deltas = self._parser.push(text) if self._parser is not None else [{"content": text}]
        return [e for d in deltas for e in self._apply(d)]

    def finish(self, reason: str | None, error: str | None, usage: Usage, code: ErrorCode | None = None) -> list[dict]:
        """The closing events, the last one the response's end (``reason``: the engine's)."""
        events = [e for d in (self._parser.finish() if self._parser is not None else []) for e in self._apply(d)]
        events += self._close()
        if self._parser is not None:  # a forced call the ceiling cut short was dropped: the calls are the answer
            reason = "stop" if finish_reason(self._parser, reason) == "tool_calls" else reason
        self.usage = usage_body(usage)
        if reason == "error" or reason is None:
            code = code.value if code is ErrorCode.DEADLINE else "server_error"
            self.status, self.error = "failed", {"code": code, "message": error or "the request ended without a result"}
        elif reason in ("length", "abort"):
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        events.append(self._event(f"response.{self.status}", response=self.snapshot()))
        return events

    def _apply(self, d: dict) -> list[dict]:
        if "content" in d:
            events = [] if self._open is not None and self._open["type"] == "message" else self._open_message()
            part = self._open["content"][0]
            part["text"] += d["content"]
            return events + [self._event("response.output_text.delta", item_id=self._open["id"],
                                         output_index=len(self.output) - 1, content_index=0, delta=d["content"],
                                         logprobs=[])]
        call = d["tool_calls"][0]
        if "id" in call:  # a new call: its item opens
            events = self._close()
            item = {"id": f"fc_{uuid.uuid4().hex[:24]}", "type": "function_call", "status": "in_progress",
                    "call_id": call["id"], "name": call["function"]["name"], "arguments": ""}
            self.output.append(item)
            self._open = item
            return events + [self._event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=copy.deepcopy(item))]
        frag = call["function"]["arguments"]
        self._open["arguments"] += frag
        return [self._event("response.function_call_arguments.delta", item_id=self._open["id"],
                            output_index=len(self.output) - 1, delta=frag)]

    def _open_message(self) -> list[dict]:
        events = self._close()
        item = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        self.output.append(item)
        self._open = item
        idx = len(self.output) - 1
        events.append(self._event("response.output_item.added", output_index=idx, item=copy.deepcopy(item)))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        events.append(self._event("response.content_part.added", item_id=item["id"], output_index=idx,
                                  content_index=0, part=copy.deepcopy(part)))
        return events

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        idx = len(self.output) - 1
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            events = [self._event("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0,
                                  text=part["text"], logprobs=[]),
                      self._event("response.content_part.done", item_id=item["id"], output_index=idx,
                                  content_index=0, part=copy.deepcopy(part))]
        else:
            events = [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                  name=item["name"], arguments=item["arguments"])]
        return events + [self._event("response.output_item.done", output_index=idx, item=copy.deepcopy(item))]
