"""The one door by which tokens and ends reach a request: a ``TokenEvent`` sequence.

Whatever carries a tick's tokens (partial emits while it runs, its events after it),
host picks and the finishes lanes report all become ``TokenEvent``s, in the order
they happened, handed to one consumer: the ``Finisher`` (finisher.py), which decides
where each request ends and hands each token to the engine's text. Nothing else
appends to a request's output.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from .. import abi
from .request import FinishReason, Request


class Source(enum.Enum):
    LANE = "lane"  # picked by the executor (it judged EOS itself)
    HOST = "host"  # picked by the request's callbacks on the host


@dataclass(frozen=True, eq=False)
class TokenEvent:
    """``token`` (None: no token, only an end) reached ``request``; ``finish``: the
    executor ended the lane here (an EOS, a length, a grammar that completed)."""

    request: Request
    token: int | None = None
    logprob: abi.LaneLogprob | None = None
    source: Source = Source.LANE
    finish: FinishReason | None = None


