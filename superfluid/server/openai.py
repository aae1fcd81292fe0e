"""The OpenAI-compatible HTTP API over an ``AsyncEngine``.

Each endpoint: parse (pydantic) -> translate and validate (ParamError -> 400)
-> tokenize -> submit every prompt (QueueFull -> 429, an invalid grammar -> 400,
all before a byte of the response goes out) -> collect or stream the deltas.
A client that disconnects aborts its requests: a streamed response's generator
is closed, a whole response watches ``is_disconnected``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..engine.async_engine import AsyncEngine, EngineDead, QueueFull, RequestStream
from ..engine.outputs import Delta
from ..engine.params import ParamError, SamplingParams
from ..engine.scheduler import GRAMMAR_DEAD_END
from . import chat as chat_api, completion_extras, render, tokenize_routes
from .errors import APIError, install_error_handlers
from .deadline import DEADLINE_CODE, deadline_s, message, with_deadline
from .limits import BodyLimit, Limits, prompt_char_cap
from .metrics import Metrics
from .protocol import ChatCompletionRequest, CompletionRequest, chat_params, completion_params, completion_prompts

DISCONNECT_POLL_S = 0.25


def create_app(
    engine: AsyncEngine, model_name: str | None = None, metrics: Metrics | None = None, drain_s: float = 0.0,
    limits: Limits = Limits(), request_timeout: float = 0.0,
) -> FastAPI:
    core = engine.engine
    name = model_name or core.model_name
    tokenizer = core.tokenizer
    if metrics is None:
        metrics = Metrics(core.scheduler, name)
    if engine.observer is None:
        engine.observer = metrics

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.stop(drain=drain_s)  # SIGTERM: no new admissions, running requests finish

    app = FastAPI(title="superfluid", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes)
    max_chars = prompt_char_cap(limits, core.desc.max_seq_len)

    def check_chars(n: int, param: str) -> None:
        # before any tokenizer work: a 100 MB prompt costs a length check, not seconds
        if n > max_chars:
            raise APIError(400, f"the {param} has {n} characters; at most {max_chars} are accepted", param,
                           "context_length_exceeded")
    engine.start()  # also without a lifespan (TestClient used without `with`)

    # ------------------------------------------------------------ helpers
    def check_model(requested: str) -> None:
        if requested != name:
            raise APIError(404, f"The model `{requested}` does not exist.", "model", "model_not_found")

    def validate(ids: list[int], params: SamplingParams) -> None:
        try:
            core.validate(ids, params)
        except ParamError as e:
            raise APIError(400, str(e), e.param, "invalid_value") from None

    async def submit_all(rid: str, prompts: list[list[int]], params: SamplingParams,
                         cache_key: str | None = None) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                streams.append(await engine.submit(f"{rid}-{i}", ids, params, cache_key=cache_key))
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, ParamError):
                raise APIError(400, str(e), e.param, "invalid_value") from None
            if isinstance(e, QueueFull):
                metrics.rejected.labels("queue_full").inc()
                raise APIError(429, f"The server is busy: {e}", None, "queue_full") from None
            if isinstance(e, EngineDead):
                raise APIError(503, str(e), None, "engine_dead") from None
            raise
        return streams

    async def merged(streams: list[RequestStream], n: int) -> AsyncIterator[tuple[int, Delta]]:
        """Deltas of several prompts' streams, as (choice index, delta)."""
        if len(streams) == 1:
            async for d in streams[0]:
                yield d.index, d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for d in s:
                    await queue.put((i * n + d.index, d))
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            live = len(tasks)
            while live:
                item = await queue.get()
                if item is None:
                    live -= 1
                    continue
                yield item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.abort()

    async def collect(request: Request, streams: list[RequestStream], n: int,
                      seconds: float | None = None) -> tuple[list[render.Choice], render.Usage]:
        choices = [render.Choice(i) for i in range(len(streams) * n)]
        usage = render.Usage()

        async def run() -> None:
            async for idx, d in with_deadline(merged, seconds)(streams, n):
                choices[idx].add(d)
                if d.finish_reason is not None:
                    usage.add_final(d)

        task = asyncio.create_task(run())
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                for s in streams:
                    s.abort()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise APIError(499, "the client disconnected", None, "client_disconnected")
        task.result()
        for c in choices:
            if c.finish_reason == "error" and seconds is not None and c.error == message(seconds):
                raise APIError(503, c.error, "timeout", DEADLINE_CODE)
            if c.finish_reason == "error" and c.error == GRAMMAR_DEAD_END:
                raise APIError(400, c.error, "response_format", "grammar_dead_end")
            if c.finish_reason == "error":
                raise APIError(500, c.error or "the request failed", None, "internal_error")
        return choices, usage

    # ------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health():
        # ok; degraded: the model's worker is being replaced (requests wait, then are
        # replayed); error: the engine stopped, or the worker cannot be restarted.
        worker = core.worker_health()
        status = "ok" if engine.alive else "error"
        if status == "ok" and worker is not None and worker["state"] != "ok":
            status = "error" if worker["state"] in ("failed", "stopped") else "degraded"
        # runtime: which numerics serve (e.g. torch:<file>:float32:det:q4_1, the fast default)
        body = {"status": status, "pid": engine.pid, "model": name, "runtime": core.desc.runtime_id}
        if worker is not None:
            body.update(worker=worker["state"], restarts=worker["restarts"], last_exit=worker["last_exit"])
            if "replicas" in worker:  # --replicas: every replica's own state
                body["replicas"] = worker["replicas"]
        return JSONResponse(body, status_code=503 if status == "error" else 200)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "superfluid",
                    "max_model_len": core.max_seq_len,
                }
            ],
        }

    tokenize_routes.install(app, core, name, check_chars)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        params = _params(completion_params, body)
        prompts, echoes = [], []
        try:
            extras = completion_extras.plan(body, core.config.max_n)
            params = extras.params(params)
            raw = completion_prompts(body)
            if body.suffix:
                raw = [completion_extras.fim_prompt(tokenizer, p, body.suffix) for p in raw]
        except ParamError as e:
            raise APIError(400, str(e), e.param, "invalid_value") from None
        if body.echo and body.logprobs is not None:
            params = params.with_(prompt_logprobs=params.logprobs)
        # echo with max_tokens 0 scores the prompt (lm-eval's loglikelihood): one token is
        # generated, for the engine needs one, and nothing of it is shown or counted
        score_only = body.echo and body.max_tokens == 0
        if score_only:
            params = params.with_(max_tokens=1)
        for p in raw:
            if isinstance(p, str):
                check_chars(len(p), "prompt")
            ids = tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
            validate(ids, params)
            prompts.append(ids)
            if body.echo:
                echoes.append(completion_extras.Echo(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids))
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await submit_all(rid, prompts, params, body.prompt_cache_key)
        k = params.logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            bounded = with_deadline(merged, deadline_s(body.timeout, request_timeout))
            return _sse(_stream_completion(streams, params.n, rid, created, name, tokenizer, k, include_usage, params, bounded,
                                           echoes, score_only))
        choices, usage = await collect(request, streams, params.n, deadline_s(body.timeout, request_timeout))
        choices = extras.select(choices, len(prompts))
        show_logprobs = body.logprobs is not None
        if score_only:
            usage.completion_tokens = 0
        for c in choices:
            if score_only:
                c.text, c.token_ids, c.logprobs, c.finish_reason = "", [], [], "length"
            if echoes:
                echoes[c.index // body.n].prepend(tokenizer, c, k if show_logprobs else None)
        return {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "logprobs": c.logprobs_body or render.completion_logprobs(tokenizer, c.token_ids, c.logprobs, k)
                    if show_logprobs
                    else None,
                    "finish_reason": render.finish_reason(c.finish_reason),
                }
                for c in choices
            ],
            "usage": usage.body(),
        }

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        params = _params(chat_params, body)
        text, tools, params = chat_api.prepare(body, tokenizer, params, check_chars)
        ids = tokenizer.encode(text, add_special_tokens=False)
        validate(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await submit_all(rid, [ids], params, body.prompt_cache_key)
        k = params.logprobs or 0
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            bounded = with_deadline(merged, deadline_s(body.timeout, request_timeout))
            return _sse(chat_api.stream(streams, params.n, rid, created, name, tokenizer, k, include_usage, params, bounded,
                                    tools))
        choices, usage = await collect(request, streams, params.n, deadline_s(body.timeout, request_timeout))
        return {
            "id": rid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [
                {
                    "index": c.index,
                    "message": msg,
                    "logprobs": render.chat_logprobs(tokenizer, c.token_ids, c.logprobs, k)
                    if params.logprobs is not None
                    else None,
                    "finish_reason": reason,
                }
                for c in choices
                for msg, reason in [chat_api.message(c, tools)]
            ],
            "usage": usage.body(),
        }

    return app


def _params(translate, body) -> SamplingParams:
    try:
        return translate(body)
    except ParamError as e:
        raise APIError(400, str(e), e.param, "invalid_value") from None


def _sse(gen) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _stream_completion(streams, n, rid, created, name, tokenizer, k, include_usage, params, merged, echoes=(),
                             score_only=False):
    usage = render.Usage()
    offsets: dict[int, int] = {}
    base = {"id": rid, "object": "text_completion", "created": created, "model": name}
    async for idx, d in merged(streams, n):
        if d.finish_reason == "error":
            yield render.error_event(d)
            continue
        if echoes and idx not in offsets:  # the prompt comes first (with its logprobs, on its first delta)
            echo = echoes[idx // n]
            lp = echo.logprobs(tokenizer, d.prompt_logprobs, k) if params.logprobs is not None else None
            offsets[idx] = len(echo.text)
            chunk = dict(base, choices=[{"index": idx, "text": echo.text, "logprobs": lp, "finish_reason": None}])
            if include_usage:
                chunk["usage"] = None
            yield render.sse(chunk)
        if score_only:  # the prompt alone: the generated token is not shown nor counted
            finish = "length" if d.finish_reason else None
            d = dataclasses.replace(d, text="", token_ids=[], logprobs=[], completion_tokens=0, finish_reason=finish)
        lp = None
        if params.logprobs is not None and d.token_ids:
            lp = render.completion_logprobs(tokenizer, d.token_ids, d.logprobs, k, offsets.get(idx, 0))
        offsets[idx] = offsets.get(idx, 0) + len(d.text)
        if d.text or d.token_ids or d.finish_reason:
            chunk = dict(base, choices=[{"index": idx, "text": d.text, "logprobs": lp, "finish_reason": render.finish_reason(d.finish_reason)}])
            if include_usage:
                chunk["usage"] = None
            yield render.sse(chunk)
        if d.finish_reason is not None:
            usage.add_final(d)
    if include_usage:
        yield render.sse(dict(base, choices=[], usage=usage.body()))
    yield render.sse("[DONE]")
