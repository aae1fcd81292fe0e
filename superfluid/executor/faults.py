"""The fault path of a tick: a lane fault ends one lane and the tick goes on; a fatal
error ends the tick through the context's one fatal path (exit 70 in a worker)."""

from __future__ import annotations

from ..abi import AdmitResult, AdmitStatus, Exactness, FaultCode, LaneFault, Status
from ..runtimes.base import Capacity, Fatal, Fault, PrimError
from .context import TickContext
from .tick_state import TickState


class FatalTick(Exception):
    """Carry-out hit something it cannot recover from; the tick answers FATAL."""

    def __init__(self, status: Status):
        super().__init__(status.name)
        self.status = status


def lane_fault_code(e: PrimError) -> int | None:
    """A primitive's error as a lane fault code; None means fatal."""
    if isinstance(e, Fault):
        return e.code
    if isinstance(e, Capacity):
        return FaultCode.OOM_TENTATIVE
    if isinstance(e, Fatal):
        return None
    return FaultCode.INTERNAL


def fatal_tick(c: TickContext, during: str) -> FatalTick:
    return FatalTick(c.fatal(during))


def fault_lane(c: TickContext, st: TickState, tag: int, code: int) -> None:
    """The lane is gone; the tick goes on. Its tag awaits a retire."""
    if tag in st.faulted:
        return
    st.faulted.add(tag)
    st.faults.append(LaneFault(tag, code, 0))
    lane = c.lanes.pop(tag, None)
    if lane is not None:
        if lane.grammar is not None:
            c.grammars.release(lane.grammar.handle)
        c.prim.seq_free(lane.seq)
        c.faulted.add(tag)
    c.injected.pop(tag, None)


def unless_fatal(c: TickContext, e: PrimError, during: str) -> None:
    """A best-effort primitive failed and its caller can do without it; a ``Fatal`` still
    takes the one fatal path."""
    if isinstance(e, Fatal):
        raise fatal_tick(c, during)


def admit_fault(c: TickContext, st: TickState, tag: int, code: int) -> None:
    """An admitted lane that could not get its sequence: the lane faults (the scheduler
    waits or preempts on OOM_TENTATIVE), the tick goes on."""
    st.admit_results.append(AdmitResult(tag, AdmitStatus.ADMITTED, 0, 0, Exactness.SEED_PATH_INVARIANT))
    st.faulted.add(tag)
    st.faults.append(LaneFault(tag, code, 0))
    c.faulted.add(tag)


def new_seq(c: TickContext, st: TickState, tag: int, during: str) -> int | None:
    """seq_create for an admitted lane: out of slots or cells is the lane's fault, never a
    FATAL tick. None: the lane faulted."""
    try:
        return c.prim.seq_create()
    except PrimError as e:
        code = lane_fault_code(e)
        if code is None:
            raise fatal_tick(c, during) from None
        admit_fault(c, st, tag, code)
        return None


def fail_step(c: TickContext, st: TickState, tags: list[int], e: PrimError, during: str) -> None:
    """A failed step faults the lanes it carried; a fatal error ends the tick."""
    code = lane_fault_code(e)
    if code is None:
        raise fatal_tick(c, during)
    for tag in tags:
        fault_lane(c, st, tag, code)
