"""The worker process: one executor over one runtime, serving its engine over a socket.

Run as ``python -m superfluid.worker --fd N --pulse NAME --runtime JSON``. It exits 0
when the engine closes the socket and 70 when the runtime fails fatally (the executor
exits then, so the supervisor starts a clean worker). A heartbeat thread and a
counter of completed runtime calls, both in the shared rings, let the supervisor
tell a live worker from a dead or stuck one.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import msgspec

from ..executor import Executor, ExecutorConfig
from ..runtimes.base import Capacity, Fatal, Fault, RuntimeDesc, RuntimePrimitives
from ..runtimes.registry import build_runtime
from . import ops, wire
from .errors import ErrorKind, Failed, failure
from .shm_rings import Pulse, SharedRings

HEARTBEAT_SECS = 0.05
_COUNTED = ("step", "step_rows", "step_sampled", "seq_copy", "seq_import", "seq_export", "seq_truncate")


def _count_progress(rt: RuntimePrimitives, pulse) -> None:
    """Every completed runtime call bumps pulse[1]: the supervisor's progress signal."""
    for name in _COUNTED:
        orig = getattr(rt, name)

        def counted(*a, _orig=orig, **k):
            out = _orig(*a, **k)
            pulse[1] += 1
            return out

        setattr(rt, name, counted)


def fail_runtime(rt: RuntimePrimitives, primitive: str, mode: str, times: int = 1, after: int = 0) -> None:
    """Test hook: make a primitive fail ("fatal", "fault", "oom", "hang", "kill") after
    ``after`` good calls, ``times`` times."""
    orig = getattr(rt, primitive)
    left = {"after": after, "times": times}

    def failing(*a, **k):
        if left["after"] > 0:
            left["after"] -= 1
            return orig(*a, **k)
        if left["times"] > 0:
            left["times"] -= 1
            if mode == "fatal":
                raise Fatal("injected fatal error")
            if mode == "fault":
                raise Fault(100, "injected fault")
            if mode == "oom":  # no room: the lane's OOM_TENTATIVE fault, the scheduler retries
                raise Capacity("injected: no room")
            if mode == "hang":
                while True:
                    time.sleep(3600)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise ValueError(f"unknown failure mode {mode!r}")
        return orig(*a, **k)

    setattr(rt, primitive, failing)


class Worker:
    """Answers the engine's frames in order: a tick, or one operation of ops.OPS,
    dispatched to the executor (ExecutorInterface) or to this worker (WorkerControl)."""

    def __init__(self, sock: socket.socket, runtime: RuntimePrimitives):
        self.sock = sock
        self.rt = runtime
        self.ex: Executor | None = None  # once the engine's rings are attached

    def serve(self) -> None:
        while True:
            try:
                frame = wire.recv_frame(self.sock)
            except wire.WireClosed:
                return
            wire.send(self.sock, self.answer(frame))

    def answer(self, frame: bytes) -> msgspec.Struct:
        try:
            msg = wire.decode_to_worker(frame)
        except msgspec.ValidationError as e:
            return Failed(ErrorKind.VALUE, f"the worker cannot read this call: {e}")
        if isinstance(msg, wire.Tick):
            return self.tick(msg)
        return self.operate(ops.BY_ARGS[type(msg)], msg)

    def tick(self, msg: wire.Tick) -> msgspec.Struct:
        if self.ex is None:
            return Failed(ErrorKind.VALUE, "no rings attached")
        on_partial = None
        if msg.partial:
            on_partial = lambda emit: wire.send(self.sock, wire.Partial(emit))  # noqa: E731
        # Not caught: a tick that raises leaves the executor in no known state, so the
        # worker dies and the supervisor replays its requests on a clean one.
        return wire.TickReply(self.ex.run_tick(msg.plan, on_partial))

    def operate(self, op: ops.Op, args: msgspec.Struct) -> msgspec.Struct:
        target = self if op.owner is ops.WorkerControl else self.ex
        if target is None:
            return Failed(ErrorKind.VALUE, f"{op.name}: no rings attached")
        try:
            result = getattr(target, op.name)(**op.kwargs(args))
            return wire.Reply(msgspec.convert(op.encode_result(result), op.result, from_attributes=True))
        except Exception as e:
            failed = failure(op.name, e)
            if failed.kind is ErrorKind.INTERNAL:
                traceback.print_exc(file=sys.stderr)  # a bug: keep its trace
            return failed

    # ---- WorkerControl
    def describe(self) -> RuntimeDesc:
        return self.rt.desc

    def attach_rings(self, spec: list, host_cache_bytes: int) -> None:
        config = ExecutorConfig(fatal_exit=True, host_cache_bytes=host_cache_bytes)
        self.ex = Executor(self.rt, SharedRings.attach(tuple(spec)), config)
        self.ex.ctx.grammars.warm()  # xgrammar's setup off the tick loop, before any request needs it

    def fail_runtime(self, primitive: str, mode: str, times: int = 1, after: int = 0) -> None:
        fail_runtime(self.rt, primitive, mode, times, after)

    def stats(self) -> dict[str, Any]:
        ex = self._executor()
        mem = self.rt.mem_counters()
        return {
            "lanes": len(ex.lanes),
            "cache_entries": len(ex.cache),
            "cache_resident_bytes": ex.cache.resident_bytes(),
            "cells_total": mem.cells_total,
            "cells_used": mem.cells_used,
            "tick_count": ex.tick_count,
            "spec_gate": {str(k): v for k, v in ex.spec_gate.summary().items()},
        }

    def _executor(self) -> Executor:
        if self.ex is None:
            raise ValueError("no rings attached")
        return self.ex


FAIL_ENV = "SUPERFLUID_FAIL_RUNTIME"


def _fail_from_env(rt: RuntimePrimitives) -> None:
    """Test hook from outside a server: ``SUPERFLUID_FAIL_RUNTIME="step:fatal:1:20"``
    (primitive:mode[:times[:after]], several separated by commas) applies
    ``fail_runtime`` to this worker's runtime. The supervisor passes it to the first
    worker it starts only, so that the clean worker that replaces it does not fail too."""
    spec = os.environ.get(FAIL_ENV, "").strip()
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) < 2 or len(parts) > 4:
            raise SystemExit(f"{FAIL_ENV}: expected primitive:mode[:times[:after]], got {item!r}")
        primitive, mode = parts[0], parts[1]
        times = int(parts[2]) if len(parts) > 2 else 1
        after = int(parts[3]) if len(parts) > 3 else 0
        fail_runtime(rt, primitive, mode, times, after)


def _heartbeat(pulse, stop: threading.Event) -> None:
    while not stop.is_set():
        pulse[0] += 1
        stop.wait(HEARTBEAT_SECS)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="superfluid.worker")
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--pulse", required=True, help="the shared-memory name of the heartbeat counters")
    ap.add_argument("--runtime", required=True, help='JSON {"kind": "toy"|"torch", "args": {...}}')
    args = ap.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine decides when this worker ends
    sock = socket.socket(fileno=args.fd)
    pulse = Pulse(args.pulse)
    stop = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(pulse.counts, stop), daemon=True)
    beat.start()
    try:
        spec = json.loads(args.runtime)
        try:
            runtime = build_runtime(spec["kind"], **spec.get("args", {}))
        except Exception as e:  # a model that cannot load: say why, then exit non-zero
            wire.send(sock, Failed(ErrorKind.LOAD, f"{type(e).__name__}: {e}"))
            return 3
        _count_progress(runtime, pulse.counts)
        _fail_from_env(runtime)
        Worker(sock, runtime).serve()
        return 0
    finally:
        # Stop beating before the interpreter unmaps the shared counters at exit: a
        # daemon thread still writing to them then crashed the exiting worker (SIGSEGV).
        stop.set()
        beat.join(1.0)


if __name__ == "__main__":
    sys.exit(main())
