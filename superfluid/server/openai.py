"""The OpenAI-compatible HTTP API over a ``ServingEngine`` (engine/serving.py: one engine
or a front door over replicas): the app factory wires routes.

Each generating endpoint: parse (pydantic) -> translate and validate (ParamError -> 400)
-> tokenize -> submit every prompt (QueueFull -> 429, an invalid grammar -> 400, all
before a byte of the response goes out: serving.py) -> collect or stream the deltas
(responder.py). Every stream is recorded and resumable (stream_hub.py): a client that
disconnects aborts its requests once no reader came back within the grace window (a stored
Responses stream runs on); a whole response watches ``is_disconnected``. ``/v1/responses``
(responses/) stores its responses (``store``: a state directory's SQLite, else memory).
"""

from __future__ import annotations

import contextlib

from fastapi import FastAPI

from .. import web
from ..engine.serving import ServingEngine
from . import chat, completions, status_routes, tokenize_routes
from .auth import ApiKey
from .responses import routes as responses_routes
from .responses.store import StoreConfig
from .errors import install_error_handlers
from .limits import BodyLimit, Limits, prompt_char_cap
from .metrics import Metrics
from .serving import Serving
from .stream_hub import StreamHub
from .stream_log import StreamConfig
from .toolcalls import registry


def create_app(
    engine: ServingEngine, model_name: str | None = None, metrics: Metrics | None = None, drain_s: float = 0.0,
    limits: Limits = Limits(), request_timeout: float = 0.0, api_key: str | None = None, web_ui: bool = True,
    streams: StreamConfig = StreamConfig(), store: StoreConfig = StoreConfig(), tool_call_parser: str = "auto",
    trust_request_chat_template: bool = False,
) -> FastAPI:
    name = model_name or engine.model_name
    if metrics is None:
        metrics = Metrics(engine.figures, name)
    if engine.observer is None:
        engine.observer = metrics

    app = FastAPI(title="superfluid", lifespan=_lifespan(engine, drain_s))
    app.state.engine = engine
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes, read_timeout=limits.body_timeout_s)
    if api_key:  # added last: it runs first, so a request without the key costs no body read
        app.add_middleware(ApiKey, key=api_key)
    serving = Serving(engine, name, metrics, prompt_char_cap(limits, engine.max_seq_len), request_timeout,
                      StreamHub(streams, idle_s=limits.stream_idle_s), registry.resolve(tool_call_parser, engine.tokenizer),
                      trust_request_chat_template)
    engine.start()  # also without a lifespan (TestClient used without `with`)

    status_routes.install(app, serving)
    tokenize_routes.install(app, engine, name, serving.check_chars)
    status_routes.install_metrics(app, metrics)
    completions.install(app, serving)
    chat.install(app, serving)
    if web_ui:  # the chat page at / (superfluid/web/): static files over the API above
        web.install(app)
    responses_routes.install(app, serving, responses_routes.open_store(store, metrics.registry))
    return app


def _lifespan(engine: ServingEngine, drain_s: float):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        yield
        engine.stop(drain=drain_s)  # SIGTERM: no new admissions, running requests finish

    return lifespan
