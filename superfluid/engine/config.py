"""Frozen configuration of the engine's parts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_running: int = 0  # lanes at once; 0: the runtime's max_batch
    prefill_token_budget: int = 512  # prompt tokens per tick, over every lane
    max_rounds: int = 8  # decode rounds per tick while nothing latency-sensitive waits
    lease_ttl_ticks: int = 4  # a leased prefix stays pinned this many ticks
    determinism_class: int = 0
    prefix_caching: bool = True
    max_replans: int = 64  # NeedsReplan answers one step may take before giving up
    max_oom_retries: int = 8  # OOM faults a request survives (re-admitted each time)
    kv_watermark: float = 0.01  # share of the pool admissions leave free
    partial_emits: bool = True  # stream tokens as picked (PARTIAL_EMITS), not per tick
    # prompt-lookup drafting, on by default: the executor's gate measures decode seconds per
    # token with and without drafts and keeps them only where they pay (benchmarks/README.md)
    speculative: bool = True
    # prompt_cache_key: keyed cache entries up to this share of the pool are never evicted
    cache_protected_fraction: float = 0.25
    # "priority" (vLLM's semantics: lower first, FCFS among equals, a better one preempts the
    # worst running lane when the batch or the pool is full) or "fcfs" (arrival order; a
    # request that names a priority is refused). All-zero priorities make both FCFS.
    scheduling_policy: str = "priority"
    priority_aging_s: float = 0.0  # > 0: every this many seconds waited counts as one priority level better
    host_threads: int = 4  # threads that run logits processors and samplers
    host_grace_s: float = 0.05  # how long a tick waits for the callbacks of rows the last tick sent out


@dataclass(frozen=True)
class EngineConfig:
    model: str = ""
    # "auto": torch where it runs the file's architecture and types, else llamacpp
    # (runtimes/auto.py; engine/loader.resolve_runtime names the pick and says why)
    runtime: str = "auto"  # | "torch" | "toy" | "llamacpp"
    runtime_reason: str = ""  # why this runtime (set when "auto" chose it)
    dtype: str | None = None
    # torch: "auto" (a GGUF on CPU decodes on the native kernel nearest its own tensor types),
    # "gguf" (each matrix in its own blocks), "none" (the reference numerics, as transformers),
    # "q8_0" | "q4_1" (requantized) (runtimes/torch/quant_choice.py)
    quant: str = "auto"
    kv_cache_mb: int = 0  # 0: the runtime's default
    max_batch: int = 0  # 0: the runtime's default
    deterministic: bool = False
    max_queued_requests: int = 256  # waiting requests beyond which new ones are refused
    max_n: int = 16  # the largest n a request may ask for
    max_request_tokens: int = 1 << 17  # n x max_tokens (capped at the context) a request may ask for
    progress: bool = False  # a progress bar while weights load
    worker: bool = False  # run the runtime in a supervised worker process
    worker_stall_timeout: float = 60.0  # a worker whose tick sees no runtime call complete this long is replaced
    host_cache_mb: int = 64  # host memory for cache entries exported out of the pool (24h retention first)
    runtime_extra: tuple[tuple[str, object], ...] = ()  # more keyword arguments for the runtime (tests: the toy's step_delay)
    scheduler: SchedulerConfig = SchedulerConfig()
