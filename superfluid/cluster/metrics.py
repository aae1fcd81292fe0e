"""The front door's /metrics: the single-engine metrics (latencies seen at the door)
plus routing and load per replica, read at scrape time."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..server.metrics import Metrics
from .router import KINDS


def cluster_metrics(cluster, model_name: str) -> Metrics:
    m = Metrics(None, model_name)
    m.registry.register(_ClusterCollector(cluster))
    return m


class _ClusterCollector:
    def __init__(self, cluster):
        self.c = cluster

    def describe(self):
        return []

    def collect(self):
        c, router = self.c, self.c.router
        routed = CounterMetricFamily("superfluid_cluster_routed_requests", "Requests routed, by replica and "
                                     "route (cache_key, prefix_hit, prefix_spill, least_loaded)", labels=["replica", "route"])
        load = GaugeMetricFamily("superfluid_cluster_replica_load", "Requests placed on the replica now", labels=["replica"])
        up = GaugeMetricFamily("superfluid_cluster_replica_up", "1 while the replica takes requests", labels=["replica"])
        running = GaugeMetricFamily("superfluid_running_requests", "Requests holding a lane", labels=["replica"])
        waiting = GaugeMetricFamily("superfluid_queue_length", "Requests waiting to run", labels=["replica"])
        hits = CounterMetricFamily("superfluid_prefix_cache_hit_tokens", "Prompt tokens prefix-cache leases covered, over every admission",
                                   labels=["replica"])
        for name, slot in c.slots.items():
            for kind in KINDS:
                routed.add_metric([name, kind], router.routed.get(name, {}).get(kind, 0))
            load.add_metric([name], router.load[name])
            up.add_metric([name], 1.0 if slot.state == "up" else 0.0)
            h = slot.health
            running.add_metric([name], h.get("running") or 0)
            waiting.add_metric([name], h.get("waiting") or 0)
            hits.add_metric([name], h.get("prefix_hit_tokens") or 0)
        yield from (routed, load, up, running, waiting, hits)
        yield CounterMetricFamily("superfluid_cluster_failovers", "Requests re-admitted off a lost replica", value=c.failovers)
        yield CounterMetricFamily("superfluid_cluster_handovers", "Requests moved off a draining replica by export/adopt",
                                  value=c.handovers)
