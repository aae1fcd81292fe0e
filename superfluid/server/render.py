"""OpenAI response bodies: completions and chat, whole and streamed (SSE).

A ``Choice`` gathers one choice's deltas; the functions here only shape JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..engine.outputs import Delta, ErrorCode, TokenLogprobs
from .errors import APIError


@dataclass
class Choice:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    prompt_logprobs: list | None = None
    logprobs_body: dict | None = None  # set when the body is not the tokens' own (echo)

    def add(self, d: Delta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        if d.finish_reason is not None:
            self.finish_reason = d.finish_reason
            self.error, self.error_code = d.error, d.error_code


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def add_final(self, d: Delta) -> None:
        """Count a choice's final delta: its tokens always, its prompt once per prompt."""
        self.completion_tokens += d.completion_tokens
        if d.index == 0:
            self.prompt_tokens += d.prompt_tokens
            self.cached_tokens += d.cached_tokens

    def body(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def finish_reason(reason: str | None) -> str | None:
    # An aborted choice (the server cut it short: an idle reader, a shutdown) says so, as
    # vLLM's "abort" does: never "length", which would claim max_tokens was reached. A
    # failed one reaches the client as an error (status or event); its reason is "stop".
    return {"error": "stop"}.get(reason, reason) if reason else None


# A failed choice's HTTP status and the request field to blame, by its code; any other: 500.
FAILURES: dict[ErrorCode, tuple[int, str | None]] = {
    ErrorCode.GRAMMAR_DEAD_END: (400, "response_format"),  # the client's grammar, not the server
    ErrorCode.INVALID_GRAMMAR: (400, "response_format"),
    ErrorCode.DEADLINE: (503, "timeout"),
    ErrorCode.SHUTTING_DOWN: (503, None),
}


def failure(code: ErrorCode | None) -> APIError:
    """The error a choice that failed with ``code`` answers with (message set by the caller)."""
    status, param = FAILURES.get(code, (500, None))
    return APIError(status, "the request failed", param, code.value if code is not None else "internal_error")


def error_event(d: Delta) -> str:
    """A failed choice in a stream: OpenAI's error body as an event (then the stream goes on)."""
    e = failure(d.error_code)
    return sse({"error": {"message": d.error or e.message, "type": e.type, "param": e.param, "code": e.code}})


def sse(obj: dict | str) -> str:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


# ------------------------------------------------------------------ logprobs


def _piece(tokenizer, token: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


# OpenAI's floor for a logprob: JSON has no -inf, and a token that logit_bias (or a grammar)
# made impossible has logprob -inf.
LOGPROB_FLOOR = -9999.0


def _finite(v: float | None) -> float | None:
    return None if v is None else (v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR)  # NaN, -inf -> the floor


def _top(entry: TokenLogprobs, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank is not None))
    return [(t, _finite(v)) for _, t, v in ranked[:k]]


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprobs], k: int) -> dict:
    content = []
    for token, entry in zip(token_ids, entries):
        text, raw = _piece(tokenizer, token)
        chosen = entry.get(token)
        top = []
        for t, v in _top(entry, k):
            tt, tb = _piece(tokenizer, t)
            top.append({"token": tt, "logprob": v, "bytes": tb})
        content.append({"token": text, "logprob": _finite(chosen.logprob) if chosen else None, "bytes": raw,
                        "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[TokenLogprobs], k: int, offset: int = 0) -> dict:
    tokens, token_lps, tops, offsets = [], [], [], []
    at = offset
    for token, entry in zip(token_ids, entries):
        text, _ = _piece(tokenizer, token)
        chosen = entry.get(token)
        tokens.append(text)
        token_lps.append(_finite(chosen.logprob) if chosen else None)
        tops.append({_piece(tokenizer, t)[0]: v for t, v in _top(entry, k)} if k else None)
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
