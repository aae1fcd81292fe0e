"""Fault isolation: a step that raises is blamed on the new requests the failed plan
could admit, never on lanes that ran before it.

A request is *untested* from its submission until a tick the executor accepted admits
it. When a step raises, the untested requests its plan was built over (``shown``) are
the suspects: one alone is the culprit; several go on *probation*, where a plan may admit
only the first of them (and requests that have run before), so a repeat failure names a
single request.
"""

from __future__ import annotations

from collections.abc import Iterable

from .request import Request


class FaultIsolation:
    def __init__(self):
        self._untested: set[int] = set()  # id(req): submitted, not yet in an accepted tick
        self._probation: list[Request] = []  # suspects of a failed step: admitted one a tick
        self._shown: list[Request] = []  # the untested requests the last plan was built over

    def submitted(self, req: Request) -> None:
        self._untested.add(id(req))

    def forget(self, req: Request) -> None:
        self._untested.discard(id(req))

    def blame(self) -> list[Request] | None:
        """The culprit of a failed step ([req]: it is to fail), [] (several suspects, now on
        probation), or None: no new request can be blamed (the fault lies with running
        lanes or the executor)."""
        suspects = [r for r in self._shown if not r.is_finished and id(r) in self._untested]
        self._shown = []
        if not suspects:
            return None
        if len(suspects) > 1:
            self._probation += [r for r in suspects if r not in self._probation]
            return []
        req = suspects[0]
        self._untested.discard(id(req))
        if req in self._probation:
            self._probation.remove(req)
        return [req]

    def admissible(self, waiting: list[Request], queued: list[Request]) -> list[Request]:
        """Of ``waiting`` (ready to admit, out of all ``queued``), those a plan may admit: all,
        except during probation, when only the first suspect and requests that have run
        before. The untested among them are remembered as the plan's suspects."""
        self._probation = [r for r in self._probation if not r.is_finished and r in queued]
        if self._probation:
            first = self._probation[0]
            waiting = [r for r in waiting if r is first or id(r) not in self._untested]
        self._shown = [r for r in waiting if id(r) in self._untested]
        return waiting

    def tested(self, admitted: Iterable[Request]) -> None:
        """The executor accepted a tick: the requests it admitted are no longer new."""
        for req in admitted:
            self._untested.discard(id(req))
            if req in self._probation:
                self._probation.remove(req)
