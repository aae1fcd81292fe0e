"""``superfluid serve --replicas N``: the OpenAI app over the replicas, plus
``POST /v1/cluster/replicas/{name}/drain`` (scale-down: the replica hands its
requests over by export/adopt, then leaves)."""

from __future__ import annotations

import sys

from ..engine.config import EngineConfig
from .launch import ClusterConfig, start_cluster
from .metrics import cluster_metrics


def build_app(config: EngineConfig, cfg: ClusterConfig, model_name: str | None = None, **app_kw):
    from ..server.errors import APIError
    from ..server.openai import create_app

    cluster = start_cluster(config, cfg, max_queued=config.max_queued_requests)
    name = model_name or cluster.model_name
    app = create_app(cluster, model_name=name, metrics=cluster_metrics(cluster, name), **app_kw)

    @app.post("/v1/cluster/replicas/{replica}/drain")
    async def drain(replica: str):
        slot = cluster.slots.get(replica)
        if slot is None:
            raise APIError(404, f"no replica {replica!r}", "replica", "not_found")
        if slot.state == "removed":
            raise APIError(409, f"replica {replica!r} has left", "replica", "conflict")
        return {"replica": replica, "handed_over": await cluster.drain_replica(replica)}

    return app, cluster


def serve_cluster(args, config: EngineConfig) -> int:
    import uvicorn

    from ..server.limits import limits_from_args
    from ..server.http_config import uvicorn_config
    from ..server.state_args import app_kwargs

    cfg = ClusterConfig(replicas=args.replicas, ray_address=args.ray_address,
                        replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus)
    print(f"superfluid: starting {cfg.replicas} replicas of {config.model} on Ray ...", file=sys.stderr, flush=True)
    app, cluster = build_app(config, cfg, args.served_model_name, drain_s=args.drain_timeout, limits=limits_from_args(args),
                             request_timeout=args.request_timeout, api_key=args.resolved_api_key,
                             web_ui=not args.no_web_ui, **app_kwargs(args))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            cluster.begin_drain(args.drain_timeout)  # no new requests; running ones finish
            super().handle_exit(sig, frame)

    print(f"superfluid: serving on http://{args.host}:{args.port}/v1 ({cfg.replicas} replicas)", file=sys.stderr, flush=True)
    Server(uvicorn_config(app, args)).run()
    return 0
