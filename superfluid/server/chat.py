"""The chat endpoint's own work: messages and tools -> prompt, choices -> messages,
and the streamed chat response (content deltas or tool-call deltas)."""

from __future__ import annotations

from ..engine.params import ParamError, SamplingParams
from . import render
from .errors import APIError
from .messages import template_messages, total_chars
from .protocol import ChatCompletionRequest
from .tool_parser import ToolCallStream, whole
from .tools import ToolPlan, plan_tools, render_chat


def prepare(body: ChatCompletionRequest, tokenizer, params: SamplingParams, check_chars) -> tuple[str, ToolPlan | None, SamplingParams]:
    """The prompt text, the tool plan, and the params with a tool grammar where one applies."""
    if not body.messages:
        raise APIError(400, "messages must not be empty", "messages", "invalid_value")
    try:
        messages = template_messages(body.messages)
        has_format = params.grammar is not None
        plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, has_format)
    except ParamError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None
    check_chars(total_chars(messages), "messages")
    try:
        text = render_chat(tokenizer, messages, plan, body.add_generation_prompt)
    except Exception as e:  # a template that rejects the conversation (roles, order)
        raise APIError(400, f"the chat template rejected the messages: {e}", "messages", "invalid_value") from None
    if plan is not None and plan.constrained:
        try:
            params = params.with_(grammar=plan.grammar())
        except (RuntimeError, ValueError) as e:  # each schema compiled alone; their union did not
            raise APIError(400, f"the tools' schemas do not combine into one grammar: {e}", "tools", "invalid_value") from None
    return text, plan, params


def message(c: render.Choice, plan: ToolPlan | None) -> tuple[dict, str | None]:
    """A whole choice's message and finish reason."""
    reason = render.finish_reason(c.finish_reason)
    if plan is None or not plan.parses:
        return {"role": "assistant", "content": c.text}, reason
    content, calls, complete = whole(plan.names, plan.constrained, c.text)
    msg: dict = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
        if complete and reason == "stop":
            reason = "tool_calls"
    return msg, reason


async def stream(streams, n, rid, created, name, tokenizer, k, include_usage, params, merged, plan: ToolPlan | None):
    usage = render.Usage()
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name}
    parsers: dict[int, ToolCallStream] = {}

    def chunk(idx: int, delta: dict, finish=None, logprobs=None) -> str:
        c = dict(base, choices=[{"index": idx, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
        if include_usage:
            c["usage"] = None
        return render.sse(c)

    def parser(idx: int) -> ToolCallStream | None:
        if plan is None or not plan.parses:
            return None
        if idx not in parsers:
            parsers[idx] = ToolCallStream(plan.names, plan.constrained)
        return parsers[idx]

    for idx in range(n * len(streams)):
        yield chunk(idx, {"role": "assistant", "content": ""})
    async for idx, d in merged(streams, n):
        if d.finish_reason == "error":
            yield render.error_event(d)
            continue
        p = parser(idx)
        if d.text or d.token_ids:
            lp = None
            if params.logprobs is not None and d.token_ids:
                lp = render.chat_logprobs(tokenizer, d.token_ids, d.logprobs, k)
            if p is not None:
                deltas = p.push(d.text)
                for i, delta in enumerate(deltas):
                    yield chunk(idx, delta, logprobs=lp if i == 0 else None)
                if lp and not deltas:
                    yield chunk(idx, {}, logprobs=lp)
            elif d.text or lp:
                yield chunk(idx, {"content": d.text}, logprobs=lp)
        if d.finish_reason is not None:
            usage.add_final(d)
            reason = render.finish_reason(d.finish_reason)
            if p is not None:
                for delta in p.finish():
                    yield chunk(idx, delta)
                if p.complete_calls and reason == "stop":
                    reason = "tool_calls"
            yield chunk(idx, {}, finish=reason)
    if include_usage:
        yield render.sse(dict(base, choices=[], usage=usage.body()))
    yield render.sse("[DONE]")

