"""What the OpenAI server may use of an engine: the ``ServingEngine`` protocol.

``AsyncEngine`` (one engine, a loop thread) and ``ClusterEngine`` (replicas on Ray behind
one front door) both implement it; superfluid/server/ sees an engine only through these
members (tests/test_serving_engine.py checks both sides).

Invariants:
- ``submit`` admits a request or raises before any text exists: ``ParamError`` (bad
  input, e.g. an invalid grammar), ``QueueFull`` (back-pressure: 429) or ``EngineDead``
  (nothing can serve: 503). The stream it returns yields every choice's deltas until each
  finished; ``abort`` (or leaving the iteration early) ends the request.
- ``figures`` are read at scrape time, from any thread: plain reads of ints. ``None``
  when the engine has no scheduler of its own (a front door reports per replica).
- ``observer`` is called on the engine's loop with each request's latencies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..runtimes.base import RuntimeDesc
    from .config import EngineConfig
    from .outputs import Delta
    from .params import SamplingParams
    from .request import ChoiceStart
    from .updates import SchedulerStats


class QueueFull(Exception):
    """More requests wait than ``max_queued`` allows."""


class EngineDead(Exception):
    """The engine stopped (or no replica serves); no request can be served."""


class Observer(Protocol):
    """What the metrics side hears (every call from the engine's loop)."""

    def first_token(self, seconds: float) -> None: ...

    def inter_token(self, seconds: float) -> None: ...

    def finished(self, delta: Delta, seconds: float) -> None: ...


class Figures(Protocol):
    """The scheduler's figures /metrics reads: queue, lanes, and the running stats."""

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def stats(self) -> SchedulerStats: ...


class DeltaStream(Protocol):
    """One admitted request's deltas, every choice's, until each finished."""

    def abort(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[Delta]: ...


@runtime_checkable
class ServingEngine(Protocol):
    """An engine the OpenAI app can serve: the model it serves, its checks, its lifecycle."""

    tokenizer: Any  # text <-> ids (superfluid.tokenizer_api), also the chat template
    model_name: str
    desc: RuntimeDesc  # runtime_id, max_seq_len, vocab_size, page
    config: EngineConfig  # max_n, runtime_reason
    observer: Observer | None  # set by the app when none was given

    @property
    def max_seq_len(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def figures(self) -> Figures | None: ...

    @property
    def alive(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ParamError for a request this engine would refuse."""

    def worker_health(self) -> dict | None:
        """``state`` (ok, starting, restarting, degraded, failed, stopped), ``restarts``,
        ``last_exit`` (and ``replicas`` behind a front door); None: no worker process."""

    def start(self) -> ServingEngine: ...

    def stop(self, timeout: float = 5.0, drain: float = 0.0) -> None: ...

    async def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     choices: list[ChoiceStart] | None = None, cache_key: str | None = None) -> DeltaStream: ...
