"""What every generating endpoint shares: the engine, the served name, the limits, and
the steps around a response — check, validate, submit every prompt, answer.

Every check and every submission happens before a byte of the response goes out, so a
bad request, a full queue or an invalid grammar is an error status, never a broken stream.
A stream is recorded and served from its record (stream_hub.py): a request that names an
event with ``Last-Event-ID`` gets the rest of that stream instead of a new generation.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterator

from fastapi import Request

from ..engine.params import ParamError, SamplingParams
from ..engine.serving import DeltaStream, EngineDead, QueueFull, ServingEngine
from .deadline import deadline_s
from .errors import APIError
from .metrics import Metrics
from .responder import Reply, RunningUsage, Shape, events, whole
from .stream_hub import StreamHub
from .toolcalls.registry import ToolSyntax


@contextlib.contextmanager
def invalid_params() -> Iterator[None]:
    """A ParamError inside becomes the 400 that names its parameter."""
    try:
        yield
    except ParamError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None


def translated(translate: Callable, body) -> SamplingParams:
    with invalid_params():
        return translate(body)


@dataclass(frozen=True)
class Serving:
    engine: ServingEngine
    name: str  # the served model name
    metrics: Metrics
    max_chars: int  # a prompt's character cap, checked before any tokenizer work
    request_timeout: float  # the server's deadline cap; 0: none
    streams: StreamHub = field(default_factory=StreamHub)  # every stream, resumable
    tool_syntax: ToolSyntax = ToolSyntax()  # how the model writes tool calls (--tool-call-parser)
    trust_request_chat_template: bool = False  # a request's chat_template is rendered, not refused

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def check_body(self, body, endpoint: str) -> None:
        """The model is the one served; the fields it ignores are logged and counted."""
        self.check_model(body.model)
        self.metrics.ignored.note(body, endpoint)

    def check_model(self, requested: str) -> None:
        if requested != self.name:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")

    def check_chars(self, n: int, param: str) -> None:
        # before any tokenizer work: a 100 MB prompt costs a length check, not seconds
        if n > self.max_chars:
            raise APIError(400, f"the {param} has {n} characters; at most {self.max_chars} are accepted", param,
                           "context_length_exceeded")

    def validate(self, ids: list[int], params: SamplingParams, requested: int | None = None,
                 param: str = "prompt") -> None:
        """``requested``: the max_tokens the client gave (None: the rest of the context,
        or the endpoint's default, clamped to it, as vLLM does). Past the context it is a
        400 in vLLM's words, not a silent clamp; ``param`` names the prompt's field."""
        limit = self.engine.max_seq_len
        if len(ids) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, your request has "
                           f"{len(ids)} input tokens. Please reduce the length of the {param}.", param,
                           "context_length_exceeded")
        if requested is not None and len(ids) + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{len(ids) + requested} tokens ({len(ids)} in the {param}, {requested} in the "
                           f"completion). Please reduce the length of the {param} or completion.", param,
                           "context_length_exceeded")
        with invalid_params():
            self.engine.validate(ids, params)

    async def submit(self, rid: str, prompts: list[list[int]], params: SamplingParams,
                     cache_key: str | None = None) -> list[DeltaStream]:
        """Every prompt's stream, or none: a failed submission aborts those already made."""
        streams: list[DeltaStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await self.engine.submit(f"{rid}-{i}", ids, params, cache_key=cache_key))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, ParamError):
                raise APIError(400, str(e), e.param, "invalid_value") from None
            if isinstance(e, QueueFull):
                self.metrics.rejected.labels("queue_full").inc()
                raise APIError(429, f"The server is busy: {e}", None, "queue_full") from None
            if isinstance(e, EngineDead):
                raise APIError(503, str(e), None, "engine_dead") from None
            raise
        return streams

    async def answer(self, request: Request, body, prefix: str, prompts: list[list[int]], params: SamplingParams,
                     shape: Shape):
        """Submit the prompts, then stream the response or answer it whole, as the body asks."""
        resumed = self.streams.resume(request) if body.stream else None
        if resumed is not None:
            return resumed
        rid = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await self.submit(rid, prompts, params, body.prompt_cache_key)
        reply = Reply(rid, created, self.name, streams, params.n, deadline_s(body.timeout, self.request_timeout))
        if body.stream:
            opts = body.stream_options
            include_usage = bool(opts and opts.include_usage)
            # vLLM: continuous_usage_stats counts only with include_usage
            running = RunningUsage(sum(map(len, prompts)), {}) if include_usage and opts.continuous_usage_stats else None
            return self.streams.record(rid, request.url.path, events(reply, shape, include_usage, running),
                                       keep_running=False)
        return await whole(request, reply, shape)
