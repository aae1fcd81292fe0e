"""Prometheus metrics: a registry per app (tests build many apps in one process).

Latencies are observed on the engine's loop thread as tokens are produced (the
``ServingEngine``'s observer); queue, running, KV and cache figures are read from the
engine's ``figures`` when Prometheus scrapes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..engine.outputs import Delta
from ..engine.serving import Figures
from .ignored_fields import IgnoredFields

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0)


class Metrics:
    def __init__(self, figures: Figures | None = None, model_name: str = ""):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("superfluid_requests", "Finished requests (choices)", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("superfluid_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("superfluid_generation_tokens", "Generated tokens of finished requests", registry=r)
        self.cached_prompt_tokens = Counter(
            "superfluid_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.ttft = Histogram(
            "superfluid_time_to_first_token_seconds", "Time to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "superfluid_inter_token_latency_seconds", "Time between two tokens of a request", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "superfluid_e2e_request_latency_seconds", "Request latency, submit to finish", buckets=_E2E_BUCKETS, registry=r
        )
        self.rejected = Counter("superfluid_rejected_requests", "Requests refused before running", ["reason"], registry=r)
        self.ignored = IgnoredFields(Counter("superfluid_ignored_request_fields",
                                             "Request fields accepted and ignored, per name", ["field"], registry=r))
        if figures is not None:
            r.register(_FiguresCollector(figures))

    # the engine's observer
    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)

    def finished(self, delta: Delta, seconds: float) -> None:
        self.requests.labels(delta.finish_reason or "unknown").inc()
        self.generation_tokens.inc(delta.completion_tokens)
        if delta.index == 0:  # a prompt counts once per request, not per choice
            self.prompt_tokens.inc(delta.prompt_tokens)
            self.cached_prompt_tokens.inc(delta.cached_tokens)
            self.e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _FiguresCollector:
    """The scheduler's figures, read at scrape time (plain reads of ints)."""

    def __init__(self, figures: Figures):
        self.s = figures

    def describe(self):
        return []

    def collect(self):
        s, st = self.s, self.s.stats
        yield GaugeMetricFamily("superfluid_queue_length", "Requests waiting to run", value=s.num_waiting)
        yield GaugeMetricFamily("superfluid_running_requests", "Requests holding a lane", value=s.num_running)
        yield GaugeMetricFamily("superfluid_kv_cache_usage_ratio", "Share of the KV pool in use", value=st.kv_usage)
        yield CounterMetricFamily(
            "superfluid_prefix_cache_hit_tokens", "Prompt tokens prefix-cache leases covered, over every admission", value=st.prefix_hit_tokens
        )
        yield CounterMetricFamily("superfluid_preemptions", "Lanes preempted for memory", value=st.preemptions)
        yield CounterMetricFamily("superfluid_ticks", "Ticks run", value=st.ticks)
        yield CounterMetricFamily("superfluid_spec_proposed_tokens", "Draft tokens proposed", value=st.spec_proposed)
        yield CounterMetricFamily("superfluid_spec_accepted_tokens", "Draft tokens accepted", value=st.spec_accepted)
        yield from _cache_classes(st)
        rate = st.spec_accepted / st.spec_proposed if st.spec_proposed else 0.0
        yield GaugeMetricFamily("superfluid_spec_acceptance_ratio", "Accepted / proposed draft tokens", value=rate)


def _cache_classes(st):
    """Per prompt_cache_key class (none, in_memory, 24h): hits, protected and exported bytes."""
    hits = CounterMetricFamily("superfluid_prompt_cache_hits", "Admissions a cached prefix served, per key class",
                               labels=["key_class"])
    resident = GaugeMetricFamily("superfluid_prompt_cache_resident_bytes", "Cache entries in the pool, per key class",
                                 labels=["key_class"])
    protected = GaugeMetricFamily("superfluid_prompt_cache_protected_bytes",
                                  "Keyed cache entries within the protected quota, per key class", labels=["key_class"])
    exported = GaugeMetricFamily("superfluid_prompt_cache_exported_bytes",
                                 "Cache entries exported to host memory, per key class", labels=["key_class"])
    for name in ("none", "in_memory", "24h"):
        hits.add_metric([name], st.cache_hits.get(name, 0))
        r, p, e = st.cache_bytes.get(name, (0, 0, 0))
        resident.add_metric([name], r)
        protected.add_metric([name], p)
        exported.add_metric([name], e)
    yield from (hits, resident, protected, exported)
