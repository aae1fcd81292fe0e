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
    name = model_name or cluster.engine.model_name
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

    from ..server.limits import H11_MAX_HEADER_BYTES, Limits
    from ..server.state_args import app_kwargs

    cfg = ClusterConfig(replicas=args.replicas, ray_address=args.ray_address,
                        replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus)
    limits = Limits(max_body_bytes=int(args.max_body_mb * (1 << 20)), max_prompt_chars=args.max_prompt_chars)
    print(f"superfluid: starting {cfg.replicas} replicas of {config.model} on Ray ...", file=sys.stderr, flush=True)
    app, cluster = build_app(config, cfg, args.served_model_name, drain_s=args.drain_timeout, limits=limits,
                             request_timeout=args.request_timeout, **app_kwargs(args))

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            cluster.begin_drain(args.drain_timeout)  # no new requests; running ones finish
            super().handle_exit(sig, frame)

    print(f"superfluid: serving on http://{args.host}:{args.port}/v1 ({cfg.replicas} replicas)", file=sys.stderr, flush=True)
    uv = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                        timeout_graceful_shutdown=args.drain_timeout + 2.0,
                        h11_max_incomplete_event_size=H11_MAX_HEADER_BYTES,
                        http="h11", loop="auto")  # h11: the header bound (httptools has none); auto: uvloop
    Server(uv).run()
    return 0
