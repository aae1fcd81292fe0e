"""``POST /v1/completions``: text or token-id prompts (with ``echo``, ``suffix``,
``best_of``: completion_extras.py) -> one response, whole or streamed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterator

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..engine.outputs import Delta
from ..engine.params import SamplingParams
from . import completion_extras, render
from .completion_extras import Echo, Extras
from .protocol import CompletionRequest, completion_params, completion_prompts
from .render import Choice, Usage
from .serving import Serving, invalid_params, translated


@dataclass
class CompletionShape:
    """A completions response: choices carry text; echo puts each prompt before its choices;
    score-only (echo with max_tokens 0) shows the prompt alone."""

    object: ClassVar[str] = "text_completion"
    chunk_object: ClassVar[str] = "text_completion"

    tokenizer: Any
    k: int  # top logprobs per token
    show_logprobs: bool  # the client asked for logprobs (best_of may ask the engine alone)
    extras: Extras
    n_prompts: int
    echoes: list[Echo]  # one per prompt when echo is on, else none
    score_only: bool
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> characters streamed (text_offset)

    def opening(self, n_choices: int) -> tuple:
        return ()

    def visible(self, d: Delta) -> Delta:
        if not self.score_only:
            return d
        # the prompt alone: the generated token is not shown nor counted
        finish = "length" if d.finish_reason else None
        return dataclasses.replace(d, text="", token_ids=[], logprobs=[], completion_tokens=0, finish_reason=finish)

    def entries(self, idx: int, d: Delta) -> Iterator[dict]:
        if self.echoes and idx not in self.offsets:  # the prompt comes first (with its logprobs, on its first delta)
            echo = self.echoes[idx // self.extras.n]
            lp = echo.logprobs(self.tokenizer, d.prompt_logprobs, self.k) if self.show_logprobs else None
            self.offsets[idx] = len(echo.text)
            yield {"index": idx, "text": echo.text, "logprobs": lp, "finish_reason": None}
        lp = None
        if self.show_logprobs and d.token_ids:
            lp = render.completion_logprobs(self.tokenizer, d.token_ids, d.logprobs, self.k, self.offsets.get(idx, 0))
        self.offsets[idx] = self.offsets.get(idx, 0) + len(d.text)
        if d.text or d.token_ids or d.finish_reason:
            yield {"index": idx, "text": d.text, "logprobs": lp, "finish_reason": render.finish_reason(d.finish_reason)}

    def shown(self, choices: list[Choice], usage: Usage) -> list[Choice]:
        choices = self.extras.select(choices, self.n_prompts)
        if self.score_only:
            usage.completion_tokens = 0
        for c in choices:
            if self.score_only:
                c.text, c.token_ids, c.logprobs, c.finish_reason = "", [], [], "length"
            if self.echoes:
                self.echoes[c.index // self.extras.n].prepend(self.tokenizer, c, self.k if self.show_logprobs else None)
        return choices

    def body(self, c: Choice) -> dict:
        lp = None
        if self.show_logprobs:
            lp = c.logprobs_body or render.completion_logprobs(self.tokenizer, c.token_ids, c.logprobs, self.k)
        return {"index": c.index, "text": c.text, "logprobs": lp, "finish_reason": render.finish_reason(c.finish_reason)}


def install(app: FastAPI, serving: Serving) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving.check_body(body, "/v1/completions")
        # tokenising (and FIM, echo text) off the event loop: a long prompt never stalls other streams
        params, prompts, shape = await run_in_threadpool(prepare, body, serving)
        return await serving.answer(request, body, "cmpl", prompts, params, shape)


def prepare(body: CompletionRequest, serving: Serving) -> tuple[SamplingParams, list[list[int]], CompletionShape]:
    """The params, the prompts' token ids and the response's shape; APIError for a bad request."""
    params = translated(completion_params, body)
    with invalid_params():
        extras = completion_extras.plan(body, serving.engine.config.max_n)
        params = extras.params(params)
        raw = completion_prompts(body)
        if body.suffix:
            raw = [completion_extras.fim_prompt(serving.tokenizer, p, body.suffix) for p in raw]
    if body.echo and body.logprobs is not None:
        params = params.with_(prompt_logprobs=params.logprobs)
    # echo with max_tokens 0 scores the prompt (lm-eval's loglikelihood): one token is
    # generated, for the engine needs one, and nothing of it is shown or counted
    score_only = body.echo and body.max_tokens == 0
    if score_only:
        params = params.with_(max_tokens=1)
    prompts, echoes = _tokenized(raw, params, serving, body.echo, body.add_special_tokens, body.max_tokens)
    # a streamed request never ranks (best_of > n is a 400), so there the engine's
    # logprobs are the client's
    shape = CompletionShape(serving.tokenizer, params.logprobs or 0, body.logprobs is not None, extras, len(prompts),
                            echoes, score_only)
    return params, prompts, shape


def _tokenized(raw: list, params: SamplingParams, serving: Serving, echo: bool, special: bool,
               asked: int | None) -> tuple[list[list[int]], list[Echo]]:
    """Text prompts tokenized with the file's BOS where it asks for one (``special``: the
    request's add_special_tokens, default true as in vLLM and llama-server); token ids as sent.
    ``asked``: the request's max_tokens, checked with each prompt against the context."""
    tokenizer = serving.tokenizer
    prompts, echoes = [], []
    for p in raw:
        if isinstance(p, str):
            serving.check_chars(len(p), "prompt")
        ids = tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p)
        serving.validate(ids, params, asked or None)  # 0 (score-only) generates one token, which always fits
        prompts.append(ids)
        if echo:
            echoes.append(Echo(p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False), ids))
    return prompts, echoes
