"""``POST /v1/chat/completions``: messages and tools -> prompt; choices -> messages,
whole or streamed (content deltas or tool-call deltas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import Delta
from ..engine.params import ParamError, SamplingParams
from . import json_bounds, render
from .errors import APIError
from .messages import template_messages, total_chars
from .protocol import ChatCompletionRequest, chat_params
from .serving import Serving, translated
from .tool_parser import AutoStream, ForcedStream, finish_reason, open_stream
from .toolcalls.registry import ToolSyntax
from .tools import ToolPlan, plan_tools, render_chat


def prepare(body: ChatCompletionRequest, tokenizer, params: SamplingParams, check_chars,
            syntax: ToolSyntax = ToolSyntax(), trust_template: bool = False,
            ) -> tuple[str, ToolPlan | None, SamplingParams]:
    """The prompt text, the tool plan, and the params with a tool grammar where one applies
    (and special tokens kept where the family's markers are special tokens).
    ``trust_template``: a ``chat_template`` sent with the request is rendered (the server
    was started with --trust-request-chat-template), else it is a 400."""
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages", "invalid_value")
    try:
        messages = template_messages(body.messages)
        has_format = params.grammar is not None
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, has_format, syntax.family)
        add_generation_prompt, template = _template_args(body, trust_template)
    except ParamError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None
    check_chars(total_chars(messages), "messages")
    try:
        text = render_chat(tokenizer, messages, plan, add_generation_prompt, **template)
    except Exception as e:  # a template that rejects the conversation (roles, order), or a request's broken one
        param = "messages" if body.chat_template is None else "chat_template"
        raise APIError(400, f"the chat template rejected the messages: {e}", param, "invalid_value") from None
    if plan is not None and plan.constrained:
        try:
            params = params.with_(grammar=plan.grammar())
        except (RuntimeError, ValueError) as e:  # each schema compiled alone; their union did not
            raise APIError(400, f"the tools' schemas do not combine into one grammar: {e}", "tools", "invalid_value") from None
    if plan is not None and plan.parses and syntax.keep_specials:
        params = params.with_(skip_special_tokens=False)
    return text, plan, params


_RESERVED = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "tokenize",
                       "chat_template"})


def _template_args(body: ChatCompletionRequest, trust_template: bool) -> tuple[bool, dict]:
    """add_generation_prompt and what else the template is given: only what the request
    set, so a tokenizer without vLLM's template arguments (the toy's) serves the rest."""
    given = body.model_fields_set
    # the request's own fields say these, not its chat_template_kwargs
    kwargs = {k: v for k, v in (body.chat_template_kwargs or {}).items() if k not in _RESERVED}
    json_bounds.check_nesting(kwargs, "chat_template_kwargs")
    if body.chat_template is not None:
        # vLLM's rule and message: a template is code the server runs (sandboxed Jinja, but
        # its loops are the client's), so only an operator who said so renders one
        if not trust_template:
            raise ParamError("Chat template is passed with request, but --trust-request-chat-template is not set. "
                             "Refused request with untrusted chat template.", "chat_template")
        kwargs["chat_template"] = body.chat_template
    add = body.add_generation_prompt
    if body.continue_final_message:
        if "add_generation_prompt" in given and add:
            raise ParamError("continue_final_message and add_generation_prompt cannot both be true",
                             "continue_final_message")
        if not body.messages or body.messages[-1].role != "assistant":
            raise ParamError("continue_final_message needs the last message to be the assistant's",
                             "continue_final_message")
        add = False
        kwargs["continue_final_message"] = True
    return add, kwargs


def message(c: render.Choice, plan: ToolPlan | None) -> tuple[dict, str | None]:
    """A whole choice's message and finish reason."""
    reason = render.finish_reason(c.finish_reason)
    if plan is None or not plan.parses:
        return {"role": "assistant", "content": c.text}, reason
    s = open_stream(plan)
    content = "".join(d.get("content", "") for d in s.push(c.text) + s.finish())
    msg: dict = {"role": "assistant", "content": content or None}
    if s.sent:
        msg["tool_calls"] = s.calls
    return msg, finish_reason(s, reason)


@dataclass
class ChatShape:
    """A chat response: choices carry a message, streamed as deltas after a role delta
    each; with a tool plan that parses, text becomes tool-call deltas."""

    object: ClassVar[str] = "chat.completion"
    chunk_object: ClassVar[str] = "chat.completion.chunk"

    tokenizer: Any
    logprobs: int | None  # top logprobs per token; None: no logprobs shown
    plan: ToolPlan | None
    parsers: dict[int, AutoStream | ForcedStream] = field(default_factory=dict)  # choice -> its calls so far

    def opening(self, n_choices: int) -> Iterator[dict]:
        for idx in range(n_choices):
            yield _entry(idx, {"role": "assistant", "content": ""})

    def visible(self, d: Delta) -> Delta:
        return d

    def entries(self, idx: int, d: Delta) -> Iterator[dict]:
        p = self._parser(idx)
        if d.text or d.token_ids:
            lp = None
            if self.logprobs is not None and d.token_ids:
                lp = render.chat_logprobs(self.tokenizer, d.token_ids, d.logprobs, self.logprobs)
            if p is not None:
                deltas = p.push(d.text)
                for i, delta in enumerate(deltas):
                    yield _entry(idx, delta, logprobs=lp if i == 0 else None)
                if lp and not deltas:
                    yield _entry(idx, {}, logprobs=lp)
            elif d.text or lp:
                yield _entry(idx, {"content": d.text}, logprobs=lp)
        if d.finish_reason is not None:
            reason = render.finish_reason(d.finish_reason)
            if p is not None:
                for delta in p.finish():
                    yield _entry(idx, delta)
                reason = finish_reason(p, reason)
            yield _entry(idx, {}, finish=reason)

    def _parser(self, idx: int) -> AutoStream | ForcedStream | None:
        if self.plan is None or not self.plan.parses:
            return None
        if idx not in self.parsers:
            self.parsers[idx] = open_stream(self.plan)
        return self.parsers[idx]

    def shown(self, choices: list[render.Choice], usage: render.Usage) -> list[render.Choice]:
        return choices

    def body(self, c: render.Choice) -> dict:
        msg, reason = message(c, self.plan)
        lp = None
        if self.logprobs is not None:
            lp = render.chat_logprobs(self.tokenizer, c.token_ids, c.logprobs, self.logprobs)
        return {"index": c.index, "message": msg, "logprobs": lp, "finish_reason": reason}


def _entry(idx: int, delta: dict, finish: str | None = None, logprobs: dict | None = None) -> dict:
    return {"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def install(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        serving.check_body(body, "/v1/chat/completions")
        # the template, the tool grammar and the tokenizer run off the event loop: a long
        # conversation never stalls other streams
        ids, plan, params = await run_in_threadpool(tokenized, body, serving)
        shape = ChatShape(serving.tokenizer, params.logprobs, plan)
        return await serving.answer(request, body, "chatcmpl", [ids], params, shape)


def tokenized(body: ChatCompletionRequest, serving: Serving) -> tuple[list[int], ToolPlan | None, SamplingParams]:
    """The prompt's token ids, the tool plan and the validated params; APIError for a bad request."""
    params = translated(chat_params, body)
    text, plan, params = prepare(body, serving.tokenizer, params, serving.check_chars, serving.tool_syntax,
                                 serving.trust_request_chat_template)
    ids = serving.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    serving.validate(ids, params, asked, "messages")
    return ids, plan, params
