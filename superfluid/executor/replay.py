"""Decode replay: a rebuilt lane's last prompt tokens fed through decode-shaped steps.

Each replayed token spends one of the lane's rounds this tick; a yield between passes
gives the pass back (its tokens are replayed next tick).
"""

from __future__ import annotations

from ..runtimes.base import Feed, PrimError
from .context import TickContext
from .faults import fail_step
from .tick_state import TickState


def replay_phase(c: TickContext, st: TickState, replaying: list[int], remaining: dict[int, int]) -> None:
    """Feed the last ``decode_replay`` prompt tokens through decode-shaped steps, one
    per round, so a rebuilt lane's state is computed as it first was. Each replayed
    token spends one of the lane's rounds this tick."""
    yield_after_pass = False
    while True:
        passing: list[tuple[int, int, bool]] = []  # (lane, token, wants_row)
        for tag in replaying:
            if remaining.get(tag, 0) <= 0 or tag not in c.lanes:
                continue
            lane = c.lanes[tag]
            at = len(lane.committed)
            if at >= len(lane.prompt):
                continue
            token = lane.prompt[at]
            last = at + 1 == len(lane.prompt)
            lane.committed.append(token)
            remaining[tag] -= 1
            if last and remaining[tag] == 0:
                lane.pending_input = token
            else:
                passing.append((tag, token, last))
        if not passing:
            break
        if yield_after_pass and c.rings.yield_requested():
            for tag, _, _ in passing:
                c.lanes[tag].committed.pop()
                remaining[tag] += 1
            break
        yield_after_pass = True
        batch = max(c.desc.max_batch, 1)
        for i in range(0, len(passing), batch):
            chunk = passing[i : i + batch]
            try:
                got = c.prim.step([Feed(c.lanes[tag].seq, [token], wants) for tag, token, wants in chunk])
            except PrimError as e:
                fail_step(c, st, [tag for tag, _, _ in chunk], e, "a decode step")
                for tag, _, _ in chunk:
                    remaining.pop(tag, None)
                continue
            it = iter(got)
            for tag, _, wants in chunk:
                if wants:
                    st.rows[tag] = next(it)
    for tag in replaying:
        if remaining.get(tag) == 0:
            remaining.pop(tag)
