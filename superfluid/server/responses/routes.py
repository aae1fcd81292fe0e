"""``POST /v1/responses``, ``GET /v1/responses/{id}`` (``?stream=true&starting_after=N``
replays its stream), ``DELETE /v1/responses/{id}``; the store's Prometheus figures."""

from __future__ import annotations

from fastapi import FastAPI, Path, Query, Request
from prometheus_client import Counter, Gauge

from ..serving import Serving
from .models import INT32_MAX, MAX_ID_CHARS, ResponsesRequest
from .service import Responses
from .store import ResponseStore, StoreConfig


def open_store(config: StoreConfig, registry) -> ResponseStore:
    """The store, its evictions counted and its size shown on ``registry``."""
    evicted = Counter("superfluid_responses_evicted", "Stored responses evicted, by bound (count, age)", ["reason"],
                      registry=registry)
    for reason in ("count", "age"):
        evicted.labels(reason)
    store = ResponseStore(config, on_evict=lambda reason, n: evicted.labels(reason).inc(n))
    Gauge("superfluid_responses_stored", "Responses in the store", registry=registry).set_function(lambda: store.count)
    return store


def install(app: FastAPI, serving: Serving, store: ResponseStore) -> Responses:
    responses = Responses(serving, store)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        return await responses.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def get(request: Request, response_id: str = Path(max_length=MAX_ID_CHARS), stream: bool = False,
                  starting_after: int | None = Query(default=None, ge=-1, le=INT32_MAX)):
        if stream:
            return responses.stream(response_id, request, starting_after)
        return await responses.get(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str = Path(max_length=MAX_ID_CHARS)):
        return await responses.delete(response_id)

    return responses
