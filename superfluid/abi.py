"""Tick records and codes: what crosses the scheduler/executor boundary.

Every record is a frozen-layout ``msgspec.Struct`` so that a plan and its events
can cross a process boundary as msgpack without pickle. Field names follow the
reference executor (superfluid-executor 0.1.4).
"""

from __future__ import annotations

from enum import IntEnum
from typing import Callable

import msgspec

MAX_TOP_LOGPROBS = 20


class Status(IntEnum):
    """What ``run_tick`` answers. Anything but OK leaves every bit of state as it was,
    except FATAL, after which the executor must not be trusted."""

    OK = 0
    REJECT_BAD_REF_GENERATION = 1
    REJECT_BOUNDS = 2
    REJECT_ILLEGAL_COMBINATION = 3
    REJECT_BUDGET = 4
    REJECT_UNKNOWN_LANE = 5
    REJECT_HOST_RULES = 6
    REJECT_STALE_NONCE = 7
    REJECT_STALE_LEASE = 8  # the reference ABI: RejectStaleSeed (a lease is a "seed" there)
    NEEDS_REPLAN = 9
    FATAL = 10


class TickStatus(IntEnum):
    OK = 0
    SHED = 1  # prefill chunks dropped or cache entries evicted
    LANE_ERRORS = 2  # at least one lane faulted


class Finish(IntEnum):
    NONE = 0
    EOS = 1
    LENGTH = 2  # the lane reached the runtime's max_seq_len
    GRAMMAR = 3  # the grammar accepted and cannot continue


class FaultCode(IntEnum):
    OOM_TENTATIVE = 1
    INTERNAL = 2
    GRAMMAR_OVERFLOW = 3
    REF_SPAN_OOB = 4
    INJECTED = 100  # first code free for tests' injected faults


class ShedKind(IntEnum):
    PREFILL_CHUNK = 1
    CACHE_EVICTION = 2


class Sampling(IntEnum):
    GREEDY = 0  # argmax, wherever the runtime runs it
    SAMPLE = 1  # temperature / top-k / top-p / min-p with a counter-based draw
    HOST = 2  # the row (grammar-masked, biased, penalised) goes to the caller, which commits a token in a later tick


class SamplingFlag:
    IGNORE_EOS = 1


class TickFlag:
    DRAIN = 1  # no admissions: the worker is shutting down
    PARTIAL_EMITS = 2  # tokens go to the plan's callback as they are picked


class Exactness(IntEnum):
    SEED_PATH_INVARIANT = 1  # same seed + same token path => same tokens
    DISTRIBUTION_EXACT = 2  # speculative: same distribution, drafts change speed only


class AdmitStatus(IntEnum):
    ADMITTED = 0


class CacheClass:
    RESIDENT_PREFIX = 1  # prefix-cache entries resident in the runtime's pool


class OpKind(IntEnum):
    EXPORT = 1
    IMPORT = 2
    LEASE = 3
    ADOPT = 4
    GRAMMAR = 5
    STRATEGY = 6


# ---------------------------------------------------------------- references


class RingRef(msgspec.Struct, frozen=True, array_like=True):
    """A span in a ring. ``generation`` names the ring's batch it was written in;
    a reference from an older batch is stale."""

    ring: int = 0
    offset: int = 0
    length: int = 0
    generation: int = 0


# --------------------------------------------------------------------- plan


class LaneParams(msgspec.Struct, frozen=True, array_like=True):
    """A lane's sampling parameters as the tick carries them (the user's are
    engine.params.SamplingParams, which turns into this plus handles)."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0  # 1.0 (or 0.0): off
    presence_penalty: float = 0.0
    freq_penalty: float = 0.0
    flags: int = 0  # SamplingFlag bits


class Lease(msgspec.Struct, frozen=True, array_like=True):
    """A lease on a cached prefix (or an adopted sequence), the one shape every layer holds:
    the handle an admit names (``LaneAdmit.lease_handle``) and how many tokens of the
    prompt the leased state holds."""

    handle: int
    prefix_len: int


class LaneAdmit(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    prompt: RingRef
    sampling: int = Sampling.GREEDY
    params: LaneParams = LaneParams()
    rng_counter_base: int = 0
    decode_replay: int = 0  # last N prompt tokens go through decode-shaped steps
    strategy_slot: int = 0
    grammar_handle: int = 0
    grammar_replay: int = 0  # last N prompt tokens advance the grammar cursor
    logit_bias_handle: int = 0
    lease_handle: int = 0  # a prefix-cache lease (the reference ABI: seed_handle)
    determinism_class: int = 0
    want_logprobs: int = 0  # 0: none; k + 1: chosen token plus top k
    # Cache the prompt (whole pages) as soon as its prefill completes, while the lane
    # runs on: the other choices of an n > 1 request fork from it. (An extension of the
    # reference, which checkpoints prompts on recurrent runtimes only.)
    publish_prompt: bool = False
    # 0: none; k + 1: each prompt token's logprob (from the prefill's rows) plus the top k.
    # Scored where the lane prefills: a seeded prefix has no rows (the scheduler leases none).
    want_prompt_logprobs: int = 0
    # prompt_cache_key: the lane's published entries carry its hash (0: unkeyed) and
    # retention (cache.Retention); keyed entries are protected within the plan's quota.
    cache_key: int = 0
    cache_retention: int = 0
    # A token rules handle (executor/token_rules.py: allowed ids, bad words, min_tokens); 0: none.
    token_rules_handle: int = 0


class PrefillChunk(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    token_offset: int  # must equal what the lane has prefilled
    token_count: int


class LaneDecode(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    max_new_tokens: int  # rounds granted this tick
    overshoot: int = 0  # extra tokens a verified draft may run past the grant


class HostCommit(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    token_id: int
    logits_nonce: int  # the generation of the row the token was sampled from


class LaneRetire(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    publish_to_cache: bool = False


class TickPlan(msgspec.Struct, frozen=True):
    plan_seq: int
    flags: int = 0
    admits: list[LaneAdmit] = []
    prefills: list[PrefillChunk] = []
    decodes: list[LaneDecode] = []
    commits: list[HostCommit] = []
    retires: list[LaneRetire] = []
    prefill_token_budget: int = 1 << 30
    max_decode_lanes: int = 0
    evictable_cache_classes: int = 0
    max_evict_bytes: int = 0
    protected_quota_bytes: int = 0  # keyed cache entries up to this many bytes are never evicted


# ------------------------------------------------------------------- events


class AdmitResult(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    status: int
    reject_code: int
    cert_id: int
    granted_class: int


class SpecStats(msgspec.Struct, frozen=True, array_like=True):
    proposed: int = 0
    accepted: int = 0
    cert_id_in_effect: int = 0


class LaneEmit(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    token_ref: RingRef
    n_tokens: int
    finish: int
    logits_row: RingRef  # host lanes: the row to sample; its generation is the nonce
    spec: SpecStats


class LaneFault(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    code: int
    detail: int = 0


class ShedEntry(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int  # 0 for the cache's own evictions
    kind: int
    reason: int
    bytes: int
    tokens: int


class ShedReport(msgspec.Struct, frozen=True):
    prefill_chunks_dropped: int = 0
    evictions_performed: int = 0
    bytes_evicted: int = 0
    entries: list[ShedEntry] = []


class OpCompletion(msgspec.Struct, frozen=True, array_like=True):
    op: int
    handle: int
    status: int = 0
    detail: int = 0


class TickTimings(msgspec.Struct, frozen=True):
    wall_ns: int = 0
    prefill_ns: int = 0
    decode_ns: int = 0


class CacheClassBytes(msgspec.Struct, frozen=True, array_like=True):
    retention: int  # cache.Retention: 0 unkeyed, 1 in_memory, 2 24h
    resident_bytes: int = 0
    protected_bytes: int = 0
    exported_bytes: int = 0


class TickMemCounters(msgspec.Struct, frozen=True):
    allocated_bytes: int = 0
    host_retained_bytes: int = 0  # cache entries exported out of the pool
    pool_blocks_total: int = 0
    pool_blocks_used: int = 0
    pool_bytes_evictable: int = 0  # unpinned, unprotected cache entries in the pool
    tentative_bytes: int = 0
    cache_classes: list[CacheClassBytes] = []


class LaneLogprob(msgspec.Struct, frozen=True, array_like=True):
    lane_tag: int
    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class PartialEmit(msgspec.Struct, frozen=True, array_like=True):
    """One token picked inside a running tick (``PARTIAL_EMITS``), with everything the
    tick's events say of it: the scheduler takes a tick's tokens from these alone."""

    lane_tag: int
    token: int
    logprob: LaneLogprob | None = None  # when the lane wants logprobs


PartialEmitCallback = Callable[[PartialEmit], None]


class PromptLogprob(msgspec.Struct, frozen=True, array_like=True):
    """Prompt token ``position`` (>= 1) scored by the row of the position before it."""

    lane_tag: int
    position: int
    token_id: int
    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class TickEvents(msgspec.Struct, frozen=True):
    plan_seq: int
    tick_status: int
    admit_results: list[AdmitResult]
    emits: list[LaneEmit]
    faults: list[LaneFault]
    shed: ShedReport
    op_completions: list[OpCompletion]
    timings: TickTimings
    mem: TickMemCounters
    logprobs: list[LaneLogprob]
    prompt_logprobs: list[PromptLogprob] = []


class TickOutcome(msgspec.Struct, frozen=True):
    """The reply to one plan: events when the status is OK, else nothing happened."""

    status: int
    events: TickEvents | None = None
