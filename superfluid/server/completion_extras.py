"""The completions endpoint's extras: ``best_of``, ``echo`` and ``suffix``.

- ``best_of`` (>= n, at most the server's max n): best_of choices are generated per
  prompt and the n with the highest cumulative logprob are returned, best first
  (OpenAI's rule; ties keep generation order). Ranking needs each token's logprob, so
  the engine is asked for them even when the client is not (and they are not shown).
  Usage counts every generated token. Streaming cannot rank before the end: 400.
- ``echo``: the prompt's text comes before each choice's text; with ``logprobs`` the
  prompt tokens' logprobs come first too (the first token has none), scored from the
  prefill's rows.
- ``suffix``: fill-in-the-middle, for a model whose vocabulary has FIM tokens; the
  prompt becomes prefix-suffix-middle (PSM). Elsewhere a 400 naming ``suffix``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.params import ParamError, SamplingParams
from . import render

# (prefix, suffix, middle) spellings: StarCoder / SantaCoder, Qwen2.5-Coder / DeepSeek-Coder-V2 style
FIM_TOKENS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<|fim▁begin|>", "<|fim▁hole|>", "<|fim▁end|>"),
)


@dataclass(frozen=True)
class Extras:
    n: int
    best_of: int
    echo: bool
    client_logprobs: int | None  # what the client asked; None: no logprobs shown

    @property
    def ranks(self) -> bool:
        return self.best_of > self.n

    def params(self, params: SamplingParams) -> SamplingParams:
        if not self.ranks:
            return params
        return params.with_(n=self.best_of, logprobs=params.logprobs if params.logprobs is not None else 0)

    def select(self, choices: list[render.Choice], n_prompts: int) -> list[render.Choice]:
        """The n best of each prompt's best_of choices, re-indexed as the client sees them."""
        if not self.ranks:
            return choices
        out = []
        for p in range(n_prompts):
            group = choices[p * self.best_of : (p + 1) * self.best_of]
            ranked = sorted(group, key=lambda c: -cumulative(c))[: self.n]
            for j, c in enumerate(ranked):
                c.index = p * self.n + j
                out.append(c)
        return out


def cumulative(c: render.Choice) -> float:
    total = 0.0
    for token, entry in zip(c.token_ids, c.logprobs):
        lp = entry.get(token)
        if lp is not None:
            total += lp.logprob
    return total


def plan(body, max_n: int) -> Extras:
    n = body.n
    best_of = n if body.best_of is None else body.best_of
    if body.best_of is None:
        return Extras(n, n, body.echo, body.logprobs)  # n's own checks apply
    if best_of < n:
        raise ParamError(f"best_of must be at least n ({n}), got {best_of}", "best_of")
    if best_of > max_n:
        raise ParamError(f"best_of must be at most {max_n}, got {best_of}", "best_of")
    if best_of > n and body.stream:
        raise ParamError("best_of greater than n cannot be streamed (choices are ranked at the end)", "best_of")
    return Extras(n, best_of, body.echo, body.logprobs)


def fim_prompt(tokenizer, prompt, suffix: str) -> str:
    """prefix-suffix-middle text for a model with FIM tokens; ParamError otherwise."""
    if not isinstance(prompt, str):
        raise ParamError("suffix needs a text prompt, not token ids", "suffix")
    backend = getattr(tokenizer, "backend", None)
    for pre, suf, mid in FIM_TOKENS:
        if backend is not None and all(backend.token_to_id(t) is not None for t in (pre, suf, mid)):
            return f"{pre}{prompt}{suf}{suffix}{mid}"
    raise ParamError("suffix (fill-in-the-middle) is not supported: this model's vocabulary has no FIM tokens",
                     "suffix")


@dataclass(frozen=True)
class Echo:
    """One prompt as echo shows it: its text, and its tokens for their logprobs."""

    text: str
    token_ids: list[int]

    def logprobs(self, tokenizer, prompt_logprobs: list | None, k: int) -> dict:
        """The prompt's part of a completions logprobs body: the first token has none."""
        entries = [e or {} for e in (prompt_logprobs or [None] * len(self.token_ids))]
        body = render.completion_logprobs(tokenizer, self.token_ids, entries, k)
        if body["top_logprobs"]:
            body["top_logprobs"][0] = None
        return body

    def prepend(self, tokenizer, c: render.Choice, k: int | None) -> None:
        """The choice's text after the prompt's; with k (logprobs asked), its logprobs too."""
        if k is not None:
            head = self.logprobs(tokenizer, c.prompt_logprobs, k)
            tail = render.completion_logprobs(tokenizer, c.token_ids, c.logprobs, k, len(self.text))
            c.logprobs_body = {key: head[key] + tail[key] for key in head}
        c.text = self.text + c.text
