"""A request as the scheduler sees it: one generation, one lane at a time.

``n > 1`` becomes n requests (one per choice) that share a group id; they share
the prompt's KV through the prefix cache, not through anything here.

Invariants:
- ``prompt_token_ids + output_token_ids`` is the token history; a re-admission
  (after preemption or an OOM fault) sends all of it as the lane's prompt with
  ``decode_replay = len(output_token_ids)`` and the same ``rng_base``, so the lane
  continues with exactly the tokens it would have produced.
- ``prefilled`` counts the history tokens the *current* lane holds (a lease's
  prefix counts); it only moves when an executor event says so.
- Handles (logit bias, grammar, an adopted lease) belong to the request's
  ``RequestHandles`` (handles.py), taken when it is submitted and released when its
  end settles (``RequestTable``), never when a lane retires: a preempted request comes
  back with them.
- ``phase`` (lifecycle.py) is the request's one state; only the scheduler's
  ``RequestTable`` changes it. This record holds data and makes no executor call.
"""

from __future__ import annotations

import enum
import itertools
import os
import time
from dataclasses import dataclass, field

from .. import abi
from ..sampling import splitmix64
from .handles import RequestHandles
from .lifecycle import ENDED, TAKES_TOKENS, Phase
from .outputs import ErrorCode
from .params import SamplingParams

_MASK64 = (1 << 64) - 1


def rng_base(seed: int | None, index: int) -> int:
    """A 64-bit counter base for choice ``index``: a pure function of the seed, so
    ``n=2`` with a seed gives two different samples that repeat across calls; a
    fresh random base without one. Bases are hashed far apart, so one choice's
    positions (base + token counter) never run into another's."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little")
    return splitmix64(splitmix64(seed & _MASK64) ^ splitmix64((index + 1) * 0x9E3779B97F4A7C15 & _MASK64))


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token or string, or a grammar that ended
    LENGTH = "length"  # max_tokens or the context
    ABORT = "abort"  # the client went away, or an engine shutdown
    ERROR = "error"  # the lane faulted and could not be recovered


@dataclass(frozen=True)
class ChoiceStart:
    """Where choice ``index`` of a request starts. A fresh request: its rng base and no
    tokens. One moved from another replica (lost or drained there): the tokens it
    generated there, which this engine decode-replays with the same rng base so that it
    continues with the text it would have had, and optionally ``lease``, the
    lease of an adopted sequence that already holds their KV."""

    index: int
    rng_base: int
    token_ids: tuple[int, ...] = ()
    lease: abi.Lease | None = None  # an adopted sequence's lease


_tags = itertools.count(1)


def next_lane_tag() -> int:
    # Every admission gets a fresh tag: the executor may still remember a retired one.
    return next(_tags)


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # max_tokens, already cut to the context
    index: int = 0  # choice index inside its group
    group_id: str = ""
    rng_base: int = 0
    arrival: float = field(default_factory=time.monotonic)

    phase: Phase = Phase.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: ErrorCode | None = None

    # the current lane
    lane_tag: int | None = None
    prefilled: int = 0
    prefill_end: int = 0  # history tokens that go through prefill (the rest: decode replay)
    replay: int = 0  # decode_replay of the current admission
    replay_pending: bool = False  # a re-admitted lane has not emitted yet

    # accounting
    cached_tokens: int = 0  # prompt tokens a lease covered at the first admission
    num_preemptions: int = 0
    num_oom_retries: int = 0
    admitted_once: bool = False
    first_token_time: float | None = None
    cache_key: int = 0  # prompt_cache_key's hash (cache_keys.py); 0: unkeyed
    cache_retention: int = 0
    # prompt position -> its score, from the prefill's rows (prompt_logprobs); a
    # re-admitted lane scores the same positions again, to the same values
    prompt_scores: dict = field(default_factory=dict)

    # host sampling (a HOST lane): a row is out and its callbacks have not answered; the
    # token they picked, to commit with the row's nonce in the next plan
    host_row_out: bool = False
    host_commit: abi.HostCommit | None = None

    # its executor handles, from submission to its end (none for a request made outside an engine)
    handles: RequestHandles = field(default_factory=RequestHandles)

    @property
    def history(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def tokens_left(self) -> int:
        return self.max_new_tokens - len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        """Its end is settled (its last delta may go out); its lane may still retire."""
        return self.phase in ENDED

    @property
    def takes_tokens(self) -> bool:
        """A token that reaches it counts: it is neither ending nor finished."""
        return self.phase in TAKES_TOKENS

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= self.prefill_end

    def held_tokens(self) -> int:
        """About how many tokens the current lane holds in the runtime."""
        if self.prefilled < self.prefill_end:
            return self.prefilled
        return len(self.prompt_token_ids) + len(self.output_token_ids)
