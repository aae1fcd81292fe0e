"""Start (or join) Ray and place the replicas: one actor each, holding the Ray resources
``--replica-cpus`` / ``--replica-gpus``; Ray restarts an actor that dies (a fresh
replica, empty cache) while the front door moves its requests elsewhere."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from ..engine.config import EngineConfig
from .frontdoor import ClusterEngine, ReplicaSlot
from .replica import ReplicaActor
from .router import Router, RouterConfig


@dataclass(frozen=True)
class ClusterConfig:
    replicas: int = 2
    ray_address: str | None = None  # None: a local Ray instance
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    max_restarts: int = 3  # per replica actor
    load_factor: float = 1.25


def init_ray(cfg: ClusterConfig) -> None:
    try:
        import ray
    except ImportError:
        raise ValueError("--replicas / LLM(replicas=N) run on Ray, which is not installed: "
                         "pip install -e '.[ray]'") from None

    if ray.is_initialized():
        return
    if cfg.ray_address:
        ray.init(address=cfg.ray_address, logging_level=logging.WARNING)
    else:  # logical resources for the replicas, not a claim on the machine's cores
        ray.init(num_cpus=max(1, int(cfg.replicas * cfg.replica_cpus + 0.999)),
                 num_gpus=int(cfg.replicas * cfg.replica_gpus + 0.999) or None,
                 include_dashboard=False, logging_level=logging.WARNING,
                 # A local Ray instance listens on loopback only: its ports run code for anyone
                 # who reaches them (a remote cluster's must be protected by its network).
                 _node_ip_address="127.0.0.1")


def start_cluster(config: EngineConfig, cfg: ClusterConfig, max_queued: int = 256) -> ClusterEngine:
    from ..engine.loader import _tokenizer_for, resolve_runtime, runtime_args

    if cfg.replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {cfg.replicas}")
    init_ray(cfg)
    import ray

    # each replica serves its model in a supervised worker of its own
    config = replace(resolve_runtime(config), worker=True, progress=False)  # one pick for every replica
    actor_cls = ray.remote(ReplicaActor)
    actors = [
        actor_cls.options(num_cpus=cfg.replica_cpus, num_gpus=cfg.replica_gpus, max_restarts=cfg.max_restarts,
                          max_task_retries=0, max_concurrency=1000).remote(f"replica-{i}", config)
        for i in range(cfg.replicas)
    ]
    infos = ray.get([a.ready.remote() for a in actors])
    slots = [ReplicaSlot(info["name"], a, info) for a, info in zip(actors, infos)]
    desc = infos[0]["desc"]
    # Routing pages are at least the router's own (16 tokens): a runtime whose cache matches
    # to the token (llamacpp, page 1) would otherwise hash only the first max_pages tokens.
    router = Router(RouterConfig(page=max(desc.page, RouterConfig.page), load_factor=cfg.load_factor))
    kind, kw, name = runtime_args(config)
    return ClusterEngine(slots, router, tokenizer=_tokenizer_for(kind, kw, desc.vocab_size), desc=desc, config=config,
                         model_name=name, max_queued=max_queued)
