"""What a generation hands back, in the shape users know from vLLM.

``RequestOutput.outputs[j]`` is choice j: ``text``, ``token_ids``,
``finish_reason``, ``logprobs`` (one dict per token: id -> Logprob, the chosen
token first, then the top ones by rank). ``Delta`` is the streaming unit: what
one choice gained since the last delta.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ErrorCode(str, enum.Enum):
    """Why a choice ended with finish_reason "error", for code to act on (``error`` is
    the text for people). The server maps each to its HTTP status (responder.py)."""

    GRAMMAR_DEAD_END = "grammar_dead_end"  # the request's grammar admits no token here
    INVALID_GRAMMAR = "invalid_grammar"  # its grammar did not compile
    NO_FIT = "does_not_fit"  # it does not fit in the KV cache, even alone
    CALLBACK_FAILED = "callback_failed"  # its own logits processor or sampler failed
    LANE_FAULT = "lane_fault"  # its lane faulted in the runtime
    BLAMED = "request_failed"  # a step that failed was blamed on it
    ENGINE_ERROR = "engine_error"  # the engine failed every request it held
    WORKER_FAILED = "worker_failed"  # the model worker could not be restarted
    SHUTTING_DOWN = "shutting_down"
    DEADLINE = "deadline_exceeded"  # past its wall-clock deadline (the server's)


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1: the most likely; None: the chosen token outside the top
    decoded_token: str | None = None


TokenLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with prompt_logprobs; the first is None
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that matched
    error: str | None = None  # finish_reason "error": why (e.g. a logits processor raised)
    error_code: ErrorCode | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens the prefix cache covered
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # vLLM's place for them (each choice has them too)

    @property
    def usage(self) -> dict:
        completion = sum(len(o.token_ids) for o in self.outputs)
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt_token_ids) + completion,
            "cached_tokens": self.num_cached_tokens,
        }


@dataclass
class Delta:
    """What choice ``index`` of group ``request_id`` gained; the last one has a finish_reason."""

    request_id: str
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # on a choice's first delta, when asked
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    error_code: ErrorCode | None = None
    # Usage figures, set on a choice's last delta.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class Outbox:
    """An engine's default output: the deltas, kept in order until taken."""

    def __init__(self):
        self._deltas: list[Delta] = []

    def __call__(self, delta: Delta) -> None:
        self._deltas.append(delta)

    def take(self) -> list[Delta]:
        out, self._deltas = self._deltas, []
        return out
