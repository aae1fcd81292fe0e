"""The engine's side of a worker: an executor over a socket, and its supervisor.

``WorkerClient`` implements ``ExecutorInterface`` by forwarding to a worker process:
``run_tick`` is written here, every other operation is made from the table in ops.py.
It is also the worker's ``Supervised``: it watches the worker while waiting on it:
the process must be alive, its heartbeat must advance, and while a request is
outstanding its runtime-call counter must advance (a worker that is alive but stuck
counts as dead). Any of these failing kills the worker and raises
``WorkerLost``; the engine then calls ``restart()`` and replays its requests on the
clean worker (handles of the old worker are gone: ``epoch`` tells them apart).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from ..abi import PartialEmitCallback, TickOutcome, TickPlan
from ..executor.interface import ExecutorInterface, Supervised
from ..runtimes.base import RuntimeDesc
from . import ops, wire
from .errors import ErrorKind, Failed, OperationFailed, WorkerFailed, WorkerLost, exception
from .ops import WorkerControl
from .shm_rings import Pulse, SharedRings

__all__ = ["OperationFailed", "WorkerClient", "WorkerConfig", "WorkerFailed", "WorkerLost"]

POLL_SECS = 0.05
FAIL_ENV = "SUPERFLUID_FAIL_RUNTIME"  # read by the worker (main.py); first start only


@dataclass(frozen=True)
class WorkerConfig:
    runtime: str = "toy"
    runtime_args: tuple[tuple[str, Any], ...] = ()
    token_capacity: int = 1 << 20
    logits_rows: int = 256
    load_timeout: float = 900.0  # model load (no progress counted yet)
    heartbeat_timeout: float = 10.0  # the heartbeat thread must beat within this
    stall_timeout: float = 60.0  # an outstanding tick must see a runtime call complete within this
    op_timeout: float = 300.0  # an operation between ticks (a grammar compiles, xgrammar imports)
    max_restarts: int = 5  # within restart_window seconds
    restart_window: float = 300.0
    backoff_first: float = 0.2
    backoff_max: float = 5.0
    host_cache_bytes: int = 64 << 20  # the executor's host memory for exported cache entries


class WorkerClient(ExecutorInterface, WorkerControl, Supervised):
    """The operations of ExecutorInterface and WorkerControl are made from ops.OPS
    below the class; what is written here is the tick, the transport and supervision."""

    def __init__(self, config: WorkerConfig):
        self.config = config
        self.pulse = Pulse()
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.rings: SharedRings | None = None
        self.desc: RuntimeDesc | None = None
        self.state = "stopped"  # starting, ok, restarting, failed, stopped
        self.epoch = 0  # bumped by each (re)start: handles from older epochs are gone
        self.restarts: list[float] = []  # restart times within restart_window
        self.restart_count = 0  # every restart since start
        self.last_exit: int | None = None
        # The worker is busy with a tick and answers in order, so a call made from a
        # partial-emit callback would take the tick's reply for its own: it is refused.
        # (Requests finish between ticks, so nothing needs to call then.)
        self._in_tick = False

    # ------------------------------------------------------------- lifecycle
    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        """Start a worker, learn its runtime, and hand it the rings (made on first start
        to the runtime's vocabulary; a restarted worker finds the same ones)."""
        self.state = "starting"
        parent, child = socket.socketpair()
        runtime = json.dumps({"kind": self.config.runtime, "args": dict(self.config.runtime_args)})
        cmd = [sys.executable, "-m", "superfluid.worker", "--fd", str(child.fileno()),
               "--pulse", self.pulse.name, "--runtime", runtime]
        self.pulse.counts[:] = 0  # no beat yet: the worker is still importing
        env = None
        if self.epoch > 0 and FAIL_ENV in os.environ:
            # The failure test hook is for the first worker only: a restarted one is clean.
            env = {k: v for k, v in os.environ.items() if k != FAIL_ENV}
        self.proc = subprocess.Popen(cmd, pass_fds=[child.fileno()], start_new_session=True, env=env)
        child.close()
        self.sock = parent
        try:
            desc = self._call(ops.BY_NAME["describe"], ops.BY_NAME["describe"].args(), timeout=self.config.load_timeout)
        except WorkerLost as e:
            if self.epoch > 0:
                raise  # restart() retries
            # The model is loaded in the worker so that a loader that aborts the process
            # (llama.cpp does on some malformed files) is this clean error, not a dead server.
            self.state = "failed"
            model = dict(self.config.runtime_args).get("model", "the model")
            raise WorkerFailed(f"{model}: the worker died while loading it ({e}); "
                               f"the {self.config.runtime} runtime cannot load this file") from None
        self.desc = desc
        if self.rings is None:
            self.rings = SharedRings(self.desc.vocab_size, self.config.token_capacity, self.config.logits_rows)
        self.rings.request_yield(False)
        self.attach_rings(list(self.rings.spec), self.config.host_cache_bytes)
        self.epoch += 1
        self.state = "ok"

    def restart(self) -> None:
        """A clean worker after a loss, with bounded retries and back-off."""
        self.state = "restarting"
        self._stop_process()
        now = time.monotonic()
        self.restarts = [t for t in self.restarts if now - t < self.config.restart_window]
        while True:
            if len(self.restarts) >= self.config.max_restarts:
                self.state = "failed"
                raise WorkerFailed(f"the worker was restarted {len(self.restarts)} times in {self.config.restart_window:.0f} s")
            delay = min(self.config.backoff_first * (2 ** len(self.restarts)), self.config.backoff_max)
            self.restarts.append(time.monotonic())
            self.restart_count += 1
            time.sleep(delay if len(self.restarts) > 1 else 0.0)
            try:
                self.start()
                return
            except WorkerLost:
                self._stop_process()
                continue

    def close(self) -> None:
        self._stop_process()
        self.state = "stopped"
        if self.rings is not None:
            self.rings.close()
            self.rings = None
        if self.pulse is not None:
            self.pulse.close()
            self.pulse = None

    def _stop_process(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                try:
                    self.proc.wait(timeout=2.0)  # a closed socket ends a healthy worker
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait()
            self.last_exit = self.proc.returncode
            self.proc = None

    def kill(self) -> None:
        """SIGKILL the worker (tests, and a stuck worker)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def health(self) -> dict:
        """A worker that has exited but is not yet replaced counts as restarting."""
        state, proc = self.state, self.proc
        if state == "ok" and (proc is None or proc.poll() is not None):
            state = "restarting"  # dead, and the supervisor has not noticed yet
        return {"state": state, "restarts": self.restart_count, "last_exit": self.last_exit}

    def check(self) -> None:
        proc = self.proc
        if self.state == "ok" and proc is not None:
            code = proc.poll()
            if code is not None:
                raise WorkerLost(f"the worker exited with status {code} while idle", code)

    # ------------------------------------------------------------ transport
    def _lost(self, why: str) -> WorkerLost:
        self.kill()
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        self.last_exit = code
        self.state = "restarting"
        return WorkerLost(why, code)

    def _wait(self, on_partial: PartialEmitCallback | None, timeout: float | None, progress: bool) -> wire.TickReply | wire.Reply | Failed:
        cfg = self.config
        pulse = self.pulse.counts
        beat, steps = int(pulse[0]), int(pulse[1])
        t_beat = t_step = t0 = time.monotonic()
        while True:
            if self.sock is None:
                raise WorkerLost("no worker")
            ready, _, _ = select.select([self.sock], [], [], POLL_SECS)
            if ready:
                try:
                    msg = wire.decode_to_engine(wire.recv_frame(self.sock))
                except (wire.WireClosed, OSError):
                    raise self._lost("the worker closed its connection") from None
                if isinstance(msg, wire.Partial):
                    if on_partial is not None:
                        on_partial(msg.emit)
                    continue
                return msg
            now = time.monotonic()
            code = self.proc.poll() if self.proc is not None else -1
            if code is not None:
                raise self._lost(f"the worker exited with status {code}")
            if int(pulse[0]) != beat:
                beat, t_beat = int(pulse[0]), now
            elif beat > 0 and now - t_beat > cfg.heartbeat_timeout:
                raise self._lost(f"no heartbeat for {now - t_beat:.1f} s")
            if int(pulse[1]) != steps:
                steps, t_step = int(pulse[1]), now
            elif progress and now - t_step > cfg.stall_timeout:
                raise self._lost(f"no progress for {now - t_step:.1f} s")
            if timeout is not None and now - t0 > timeout:
                raise self._lost(f"no answer in {timeout:.0f} s")

    def _call(self, op: ops.Op, args: msgspec.Struct, timeout: float | None = None) -> Any:
        if self._in_tick:
            raise RuntimeError(f"{op.name!r} called while a tick runs (from a partial-emit callback)")
        if self.sock is None:
            raise WorkerLost("the worker is not running")
        try:
            wire.send(self.sock, args)
        except OSError:
            raise self._lost("the worker's connection broke") from None
        reply = self._wait(None, timeout if timeout is not None else self.config.op_timeout, False)
        if isinstance(reply, Failed):
            if reply.kind is ErrorKind.LOAD:
                self.state = "failed"
            raise exception(reply)
        if not isinstance(reply, wire.Reply):
            raise self._lost(f"the worker answered {op.name} with {type(reply).__name__}")
        return msgspec.convert(reply.value, op.result)

    # ------------------------------------------------------------- the tick
    def run_tick(self, plan: TickPlan, on_partial_emit: PartialEmitCallback | None = None) -> TickOutcome:
        if self.sock is None:
            raise WorkerLost("the worker is not running")
        try:
            wire.send(self.sock, wire.Tick(plan, on_partial_emit is not None))
        except OSError:
            raise self._lost("the worker's connection broke") from None
        self._in_tick = True
        try:
            reply = self._wait(on_partial_emit, None, True)
        finally:
            self._in_tick = False
        if not isinstance(reply, wire.TickReply):
            raise self._lost(f"the worker answered a tick with {reply!r}")
        return reply.outcome


def _forward(op: ops.Op) -> Callable[..., Any]:
    def forward(self: WorkerClient, *args: Any, **kwargs: Any) -> Any:
        return self._call(op, op.args(*args, **kwargs))

    forward.__name__, forward.__qualname__ = op.name, f"WorkerClient.{op.name}"
    forward.__signature__ = op.signature  # type: ignore[attr-defined]
    forward.__doc__ = op.doc
    return forward


for _op in ops.OPS:
    setattr(WorkerClient, _op.name, _forward(_op))
