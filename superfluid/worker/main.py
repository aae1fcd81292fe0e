"""The worker process: one executor over one runtime, serving its engine over a socket.

Run as ``python -m superfluid.worker --fd N --rings JSON --runtime JSON``. It exits 0
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
from dataclasses import asdict
from typing import Any

from ..executor import Executor, ExecutorConfig, SpecConfig
from ..executor.grammar_errors import GrammarError
from ..runtimes.base import Capacity, Fatal, Fault, PrimError, RuntimePrimitives
from ..runtimes.registry import build_runtime
from . import payload, wire
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
    def __init__(self, sock: socket.socket, runtime: RuntimePrimitives):
        self.sock = sock
        self.rt = runtime
        self.ex: Executor | None = None  # once the engine's rings are attached

    def serve(self) -> None:
        while True:
            try:
                msg = wire.decode_to_worker(wire.recv_frame(self.sock))
            except wire.WireClosed:
                return
            if isinstance(msg, wire.Tick) and self.ex is None:
                wire.send(self.sock, wire.Reply(error="no rings attached", error_kind="ValueError"))
                continue
            if isinstance(msg, wire.Tick):
                on_partial = None
                if msg.partial:
                    on_partial = lambda tag, tok: wire.send(self.sock, wire.Partial(tag, tok))  # noqa: E731
                wire.send(self.sock, wire.Reply(outcome=self.ex.run_tick(msg.plan, on_partial)))
                continue
            try:
                value = getattr(self, "op_" + msg.op)(*msg.args)
                reply = wire.Reply(value=value)
            except AttributeError as e:
                reply = wire.Reply(error=f"unknown operation {msg.op!r}: {e}", error_kind="ValueError")
            except GrammarError as e:
                reply = wire.Reply(error=str(e), error_kind="GrammarError")
            except (ValueError, KeyError, PrimError) as e:
                reply = wire.Reply(error=str(e), error_kind=type(e).__name__)
            wire.send(self.sock, reply)

    # ---- operations (each returns something msgpack can carry)
    def op_describe(self) -> dict[str, Any]:
        return {"desc": asdict(self.rt.desc), "pid": os.getpid()}

    def op_attach_rings(self, spec: list, host_cache_bytes: int = ExecutorConfig.host_cache_bytes) -> None:
        config = ExecutorConfig(fatal_exit=True, host_cache_bytes=host_cache_bytes)
        self.ex = Executor(self.rt, SharedRings.attach(tuple(spec)), config)

    def op_ping(self) -> int:
        return os.getpid()

    def op_lease_seed(self, prompt: list[int], ttl: int, determinism: int, cache_key: int = 0) -> list | None:
        lease = self.ex.lease_seed(prompt, ttl, determinism, cache_key)
        return None if lease is None else [lease.handle, lease.prefix_len]

    def op_release_seed(self, handle: int) -> None:
        self.ex.release_seed(handle)

    def op_register_logit_bias(self, pairs: list[list]) -> int:
        return self.ex.register_logit_bias({int(i): float(v) for i, v in pairs})

    def op_release_logit_bias(self, handle: int) -> None:
        self.ex.release_logit_bias(handle)

    def op_compile_grammar(self, kind: str, source: str | None) -> int:
        return self.ex.compile_grammar(kind, source)

    def op_release_grammar(self, handle: int) -> None:
        self.ex.release_grammar(handle)

    def op_load_strategy(self, cfg: dict[str, Any]) -> int:
        return self.ex.load_strategy(SpecConfig(**cfg))

    def op_inject_fault(self, lane_tag: int, code: int) -> None:
        self.ex.inject_fault(lane_tag, code)

    def op_export_entries(self, ids: list[int] | None) -> list[int]:
        return self.ex.export_entries(ids)

    def op_import_entries(self, ids: list[int] | None) -> list[int]:
        return self.ex.import_entries(ids)

    def op_export_prefix(self, tokens: list[int]) -> list | None:
        got = self.ex.export_prefix(tokens)
        return None if got is None else [got[0], payload.encode(got[1])]

    def op_adopt(self, tokens: list[int], data: Any, ttl: int, determinism: int) -> list:
        lease = self.ex.adopt(tokens, payload.decode(data), ttl, determinism)
        return [lease.handle, lease.prefix_len]

    def op_fail_runtime(self, primitive: str, mode: str, times: int, after: int) -> None:
        fail_runtime(self.rt, primitive, mode, times, after)

    def op_stats(self) -> dict[str, Any]:
        mem = self.rt.mem_counters()
        return {
            "lanes": len(self.ex.lanes),
            "cache_entries": len(self.ex.cache),
            "cache_resident_bytes": self.ex.cache.resident_bytes(),
            "cells_total": mem.cells_total,
            "cells_used": mem.cells_used,
            "tick_count": self.ex.tick_count,
            "spec_gate": {str(k): v for k, v in self.ex.spec_gate.summary().items()},
        }


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
            wire.send(sock, wire.Reply(error=f"{type(e).__name__}: {e}", error_kind="LoadError"))
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
