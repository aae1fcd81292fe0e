"""Speculative decoding by prompt lookup, with per-lane depth and a measured gate.

- ``propose``: the longest recent n-gram of the lane's committed tokens that occurred
  before; the tokens that followed it are the draft.
- ``LaneSpec``: a lane's draft depth grows while drafts are accepted whole and shrinks
  when they miss; after a run of misses the lane rests a few rounds.
- ``SpecGate``: decode seconds per token, with and without drafting, at each lane
  count (bucketed by powers of two). Drafting stays on only where it made decoding faster; each side is
  re-measured now and then so a change of workload is noticed.

Drafts never change text: every verified row is sampled as a plain decode would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SpecConfig:
    # Most tokens drafted per round. A verification of k drafts is one step of k + 1 rows,
    # and past 4 rows the native GEMV's step cost climbs steeply (AMD EPYC Zen 5, SmolLM2
    # q4_1, one lane: 2 / 3 / 4 / 5 / 7 rows cost 1.12 / 1.43 / 1.50 / 1.89 / 3.42 one-row
    # steps; llama.cpp's CPU kernels scale about linearly: 1.9x at 2). With acceptance
    # around 0.8 (grounded prompts) expected tokens per cost peak at 3 drafts; paired
    # in-process runs on grounded c=1 gave 1.25x over no drafting at 3, 1.23x at 4 and
    # 1.06x at 6.
    max_depth: int = 3
    min_ngram: int = 1
    max_ngram: int = 3
    cert_id: int = 1  # names this configuration in AdmitResult / SpecStats
    gate_samples: int = 3  # ticks measured on each side before the gate decides
    gate_refresh: int = 64  # decisions between re-measurements of the losing side
    rest_rounds: int = 4  # rounds a lane skips drafting after repeated misses


def propose(committed: list[int], k: int, cfg: SpecConfig = SpecConfig()) -> list[int]:
    if k <= 0 or len(committed) < 2:
        return []
    tokens = np.asarray(committed, dtype=np.int64)
    for n in range(min(cfg.max_ngram, len(tokens) - 1), cfg.min_ngram - 1, -1):
        tail = tokens[-n:]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)  # [len-n, n]
        hits = np.flatnonzero((windows == tail).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the most recent earlier occurrence
            draft = tokens[start : start + k]
            if draft.size:
                return draft.tolist()
    return []


@dataclass
class LaneSpec:
    depth: int
    misses: int = 0
    resting: int = 0

    @classmethod
    def new(cls, cfg: SpecConfig) -> "LaneSpec":
        return cls(depth=max(1, cfg.max_depth // 2))

    def drafting(self) -> bool:
        if self.resting > 0:
            self.resting -= 1
            return False
        return True

    def record(self, cfg: SpecConfig, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        if accepted == proposed:
            self.depth = min(cfg.max_depth, self.depth + 1)
            self.misses = 0
        elif accepted == 0:
            self.depth = max(1, self.depth - 1)
            self.misses += 1
            if self.misses >= 3:
                self.resting, self.misses = cfg.rest_rounds, 0
        else:
            self.depth = max(1, accepted + 1)
            self.misses = 0


@dataclass
class _Side:
    secs: float = 0.0
    tokens: int = 0
    samples: int = 0

    def add(self, secs: float, tokens: int) -> None:
        # Exponential forgetting keeps the figure current as the workload shifts.
        if self.samples >= 8:
            self.secs *= 0.75
            self.tokens = int(self.tokens * 0.75)
        self.secs += secs
        self.tokens += tokens
        self.samples += 1

    def spt(self) -> float:
        return self.secs / max(self.tokens, 1)


def lane_bucket(lanes: int) -> int:
    """The gate's key: lane counts by powers of two (1, 2-3, 4-7, ...). Drafting pays alike
    at 30 and 31 lanes, and one key per exact count would re-explore both sides (drafting
    where it loses) every time a batch shrinks by one as its requests finish."""
    return 1 << (max(lanes, 1).bit_length() - 1)


@dataclass
class SpecGate:
    on: dict[int, _Side] = field(default_factory=dict)
    off: dict[int, _Side] = field(default_factory=dict)
    decisions: int = 0

    def allows(self, cfg: SpecConfig, lanes: int) -> bool:
        lanes = lane_bucket(lanes)
        on = self.on.get(lanes, _Side())
        off = self.off.get(lanes, _Side())
        if on.samples < cfg.gate_samples:
            return True
        if off.samples < cfg.gate_samples:
            return False
        self.decisions += 1
        winner_on = on.spt() <= off.spt()
        if self.decisions % cfg.gate_refresh == 0:
            return not winner_on  # measure the losing side again
        return winner_on

    def record(self, cfg: SpecConfig, lanes: int, drafted: bool, secs: float, tokens: int) -> None:
        side = (self.on if drafted else self.off).setdefault(lane_bucket(lanes), _Side())
        side.add(secs, tokens)

    def summary(self) -> dict[int, dict[str, float]]:
        out = {}
        for lanes in sorted(set(self.on) | set(self.off)):
            on, off = self.on.get(lanes, _Side()), self.off.get(lanes, _Side())
            out[lanes] = {"on_spt": on.spt(), "off_spt": off.spt(), "on_samples": on.samples, "off_samples": off.samples}
        return out
