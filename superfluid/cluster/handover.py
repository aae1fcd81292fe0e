"""A draining replica's requests, packed for another replica to continue them.

Run on the engine's loop thread (``ReplicaEngine.call``) between ticks: every request
is detached (its running lanes retire *publishing* their KV to the cache, in a
retire-only tick), then each unfinished choice's longest cached prefix is exported.
The receiving replica adopts each payload as a bare sequence leased to that choice's
admit, so the choice starts from the exported KV and decode-replays only the tokens
past the last whole page -- the state is moved, not recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..engine.engine import Engine
from ..engine.request import ChoiceStart

HANDOVER_TTL_TICKS = 1 << 20  # an adopted lease waits for its admit (a replica under load queues it)


@dataclass
class HandedChoice:
    index: int
    rng_base: int
    token_ids: list[int]
    prefix: tuple[list[int], object] | None = None  # (tokens, payload) from export_prefix


@dataclass
class HandedOver:
    """One request's unfinished choices as they stood when its replica let it go."""

    request_id: str
    choices: list[HandedChoice] = field(default_factory=list)


def hand_over(engine: Engine, request_ids: list[str]) -> dict[str, HandedOver]:
    engine.scheduler.draining = True  # admits nothing from here on
    detached = {rid: engine.detach(rid) for rid in request_ids}
    engine.scheduler.flush_retires()  # publish the lanes' KV to the cache
    out: dict[str, HandedOver] = {}
    for rid, reqs in detached.items():
        h = out[rid] = HandedOver(rid)
        for req in reqs:
            try:
                prefix = engine.ex.export_prefix(req.history)
            except Exception:  # an export that fails costs recompute, never the request
                prefix = None
            h.choices.append(HandedChoice(req.index, req.rng_base, list(req.output_token_ids), prefix))
    return out


def adopt_choices(engine: Engine, choices: list[HandedChoice], prompt: list[int]) -> list[ChoiceStart]:
    """On the receiving replica: lease each exported prefix to its choice (a payload
    that does not fit or no longer matches is dropped: that choice prefills instead)."""
    starts = []
    for c in choices:
        leased = None
        history = list(prompt) + list(c.token_ids)
        if c.prefix is not None and engine.config.scheduler.prefix_caching:
            tokens, payload = c.prefix
            if history[: len(tokens)] == list(tokens):
                try:
                    leased = engine.ex.adopt(list(tokens), payload, HANDOVER_TTL_TICKS,
                                             engine.config.scheduler.determinism_class)
                except Exception:
                    leased = None
        starts.append(ChoiceStart(c.index, c.rng_base, tuple(c.token_ids), leased))
    return starts
