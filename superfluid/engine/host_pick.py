"""One host-side pick: a HOST lane's row through the user's callbacks to a token.

The row arrives processed as far as the executor's order goes (grammar mask, logit
bias, penalties); here come the logits processors, in order, then the sampler, or
else the pick every other lane gets (greedy argmax, or the draw at
``uniform(rng_base + position)``), so processors that leave the row unchanged give
exactly the engine-sampled tokens. Logprobs are taken from the row the pick saw,
before temperature, as the executor takes them.

A callback that raises, returns a row of the wrong shape, or picks a token outside
the vocabulary (or one the grammar masked out) is a ``HostPickError``: that request
fails, nothing else does.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .. import abi
from ..abi import MAX_TOP_LOGPROBS
from .. import sampling as hs
from .params import SamplingParams


class HostPickError(Exception):
    """A request's own callback failed; the message is for its client."""


@dataclass(frozen=True)
class PickInput:
    params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # what the request generated before this row
    row: np.ndarray  # float32 [V], private to this pick
    rng_base: int


@dataclass(frozen=True)
class Picked:
    token: int
    logprob: abi.LaneLogprob | None  # lane_tag left 0: the scheduler knows the lane


def _takes_prompt(fn: Callable) -> bool:
    """vLLM's two forms: fn(output_ids, logits) or fn(prompt_ids, output_ids, logits)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: the common form
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    return len(positional) >= 3


def _call(fn: Callable, what: str, inp: PickInput, row: np.ndarray):
    args = (list(inp.output_token_ids), row)
    if _takes_prompt(fn):
        args = (list(inp.prompt_token_ids),) + args
    try:
        return fn(*args)
    except Exception as e:  # the user's code: any failure is this request's
        raise HostPickError(f"{what} raised {type(e).__name__}: {e}") from e


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def pick(inp: PickInput) -> Picked:
    p = inp.params
    vocab = inp.row.shape[0]
    masked = ~np.isfinite(inp.row) if p.grammar is not None else None  # what the grammar ruled out
    row = inp.row
    for i, fn in enumerate(p.logits_processors):
        what = f"logits processor {i} ({_name(fn)})"
        out = _call(fn, what, inp, row)
        try:
            out = np.asarray(out.detach().cpu().numpy() if hasattr(out, "detach") else out, dtype=np.float32)
        except (TypeError, ValueError) as e:
            raise HostPickError(f"{what} returned {type(out).__name__}, not an array of logits") from e
        if out.shape != (vocab,):
            raise HostPickError(f"{what} returned logits of shape {out.shape}; expected ({vocab},)")
        row = out
        if not (row > -np.inf).any():  # NaN compares false too
            raise HostPickError(f"{what} left every token at -inf (or NaN)")
    position = len(inp.output_token_ids)
    if p.sampler is not None:
        got = _call(p.sampler, f"sampler ({_name(p.sampler)})", inp, row)
        if isinstance(got, (bool, np.bool_)) or not isinstance(got, (int, np.integer)):
            raise HostPickError(f"sampler ({_name(p.sampler)}) returned {type(got).__name__}, not a token id")
        token = int(got)
    elif p.greedy:
        token = hs.argmax(row)
    else:
        token = hs.sample(row, p.abi_params(), hs.uniform(inp.rng_base + position))
    if not 0 <= token < vocab:
        raise HostPickError(f"the sampler returned token id {token}, outside the vocabulary (0..{vocab - 1})")
    if masked is not None and masked[token]:
        raise HostPickError(f"token id {token} is ruled out by the response format's grammar here")
    lp = None
    if p.logprobs is not None:
        value, top = hs.logprobs(row, token, min(p.logprobs, MAX_TOP_LOGPROBS))
        lp = abi.LaneLogprob(0, token, value, [i for i, _ in top], [v for _, v in top])
    return Picked(token, lp)
