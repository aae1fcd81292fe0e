"""``GET /health``, ``GET /v1/models`` and ``GET /metrics`` (Prometheus)."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from .errors import APIError
from .metrics import Metrics
from .serving import Serving


def install(app: FastAPI, serving: Serving) -> None:
    engine, name = serving.engine, serving.name

    @app.get("/health")
    async def health():
        # ok; degraded: the model's worker is being replaced (requests wait, then are
        # replayed); error: the engine stopped, or the worker cannot be restarted.
        worker = engine.worker_health()
        status = "ok" if engine.alive else "error"
        if status == "ok" and worker is not None and worker["state"] != "ok":
            status = "error" if worker["state"] in ("failed", "stopped") else "degraded"
        # runtime: which numerics serve (e.g. torch:<file>:float32:det:q4_1, the fast default)
        body = {"status": status, "pid": engine.pid, "model": name, "runtime": engine.desc.runtime_id}
        if engine.config.runtime_reason:  # --runtime auto: why this runtime
            body["runtime_reason"] = engine.config.runtime_reason
        if worker is not None:
            body.update(worker=worker["state"], restarts=worker["restarts"], last_exit=worker["last_exit"])
            if "replicas" in worker:  # --replicas: every replica's own state
                body["replicas"] = worker["replicas"]
        return JSONResponse(body, status_code=503 if status == "error" else 200)

    def model_object() -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "superfluid",
                "max_model_len": engine.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_object()]}

    # the openai client's models.retrieve; an id with a slash (org/model) is one id
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != name:
            raise APIError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_object()


def install_metrics(app: FastAPI, metrics: Metrics) -> None:
    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
