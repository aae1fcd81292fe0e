"""What to give up when the executor answers a plan with ``NeedsReplan`` (it could not
fit the plan's memory), in order: fewer admissions, one decode round, a preempted lane,
retires without publishing; a request that cannot fit alone fails.

``relieve`` only decides; the scheduler carries the decision out and plans again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .planner import Limits, ScheduledTick
from .request import Request
from .updates import SchedulerError

NO_FIT = "the request does not fit in the KV cache"


@dataclass
class Relief:
    limits: Limits  # the next plan's limits
    preempt: Request | None = None  # retire this lane unpublished and requeue it
    fail: Request | None = None  # finish this request with NO_FIT


def relieve(tick: ScheduledTick, limits: Limits, live: list[Request], orphans: bool,
            worst: Callable[[list[Request]], Request]) -> Relief:
    """The next concession for a plan that did not fit. ``live``: running lanes not
    retiring; ``orphans``: the plan retires preempted lanes; ``worst``: the lane that
    gives way first (the priority policy's). Raises when nothing is left to give up."""
    if tick.admissions:
        if not live and len(tick.admissions) == 1 and not orphans:
            return Relief(limits, fail=tick.admissions[0].request)
        limits.max_admits = len(tick.admissions) - 1
        return Relief(limits)
    if any(k > 1 for k in tick.decodes.values()) and limits.rounds != 1:
        limits.rounds = 1
        return Relief(limits)
    if len(live) > 1:
        limits.max_admits = 0  # not this tick: the preempted request would come right back
        return Relief(limits, preempt=worst(live))
    if any(r.publish_to_cache for r in tick.plan.retires) and limits.publish_retires:
        limits.publish_retires = False  # publishing needs cells: retire without it
        return Relief(limits)
    if live:
        return Relief(limits, fail=live[0])
    raise SchedulerError("NeedsReplan with nothing left to give up")
