"""Where each request ends, decided token by token: the one consumer of TokenEvents.

The order of the rules, for a token that reaches a request: a stop token id (STOP),
``max_tokens`` or the context (LENGTH), an EOS the host picked (STOP; the executor
judges the EOS of the tokens it picks and reports it as the event's ``finish``), a stop
string its text completed (STOP, told by the engine's ``text``), then the ``finish``
the event carries. The first verdict wins; a request with one takes no more tokens.

A verdict only marks the request ENDING (``Ended``): its end settles between ticks
(``Settled``), so whatever a token ends, nothing is released while a tick runs.
"""

from __future__ import annotations

from typing import Callable

from .. import abi
from .request import FinishReason, Request
from .request_table import Ended, RequestTable
from .token_events import Source, TokenEvent

# The engine's side of a token: its text (deltas go out from there); True when a stop
# string ended the request at this token.
TextSink = Callable[[Request, int, "abi.LaneLogprob | None"], bool]


class Finisher:
    def __init__(self, table: RequestTable, eos_ids: frozenset[int] = frozenset()):
        self.table = table
        self.eos_ids = eos_ids
        self.text: TextSink | None = None  # the engine's; None: tokens only (a bare scheduler)

    def take(self, ev: TokenEvent) -> None:
        req = ev.request
        if not req.takes_tokens:
            return  # it ended earlier (within this tick, maybe): the rest never happened
        reason = ev.finish
        if ev.token is not None:
            req.output_token_ids.append(ev.token)
            stopped = self.text(req, ev.token, ev.logprob) if self.text is not None else False
            reason = self._verdict(req, ev, stopped) or reason
        if reason is not None:
            self.table.apply(Ended(req, reason))

    def _verdict(self, req: Request, ev: TokenEvent, stopped: bool) -> FinishReason | None:
        p = req.params
        if ev.token in p.stop_token_ids:
            return FinishReason.STOP
        if req.tokens_left <= 0:
            return FinishReason.LENGTH
        if ev.source is Source.HOST and ev.token in self.eos_ids and not p.ignore_eos:
            return FinishReason.STOP
        if stopped:
            return FinishReason.STOP
        return None
