"""The operations that cross the worker's socket: one table.

The signatures come from two Protocols: ``ExecutorInterface`` (the executor's
operations between ticks) and ``WorkerControl`` below (the worker's own). Each
operation crosses as a struct tagged with its name whose fields are its parameters,
made from its signature, so the wire cannot drift from the Protocol. The table adds
only what a signature cannot say: the result's wire type, a payload's adapters on the
worker's side, and which calls may wait for a running tick. ``WorkerClient``'s
methods and the worker's dispatch are both made from it. (``run_tick`` has its own
messages: wire.Tick, wire.Partial, wire.TickReply.)
"""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import msgspec

from ..abi import Lease
from ..executor.interface import ExecutorInterface
from ..runtimes.base import RuntimeDesc
from . import payload


class WorkerControl(Protocol):
    """The worker's own operations, beside the executor's."""

    def describe(self) -> RuntimeDesc:
        """The runtime's description; the first answer of a worker that loaded its model."""

    def attach_rings(self, spec: list[Any], host_cache_bytes: int) -> None:
        """Attach the engine's shared rings and make the executor over them."""

    def fail_runtime(self, primitive: str, mode: str, times: int = 1, after: int = 0) -> None:
        """Test hook: make a runtime primitive fail (fatal, fault, oom, hang, kill)."""

    def stats(self) -> dict[str, Any]:
        """Counters of the executor and its runtime."""


def _same(x: Any) -> Any:
    return x


@dataclass(frozen=True)
class Op:
    name: str
    owner: type  # the Protocol that states its signature
    result: Any  # the msgspec type of the reply's value
    args: type[msgspec.Struct]  # tagged with the name; fields: the parameters
    signature: inspect.Signature
    doc: str | None
    decode_args: Callable[[dict[str, Any]], dict[str, Any]] = _same  # worker: wire -> the method's arguments
    encode_result: Callable[[Any], Any] = _same  # worker: the method's result -> wire

    def kwargs(self, args: msgspec.Struct) -> dict[str, Any]:
        return self.decode_args({f: getattr(args, f) for f in self.args.__struct_fields__})


def _op(owner: type, name: str, result: Any, **extra: Any) -> Op:
    fn = getattr(owner, name)
    sig = inspect.signature(fn)
    hints = typing.get_type_hints(fn)
    fields = []
    for p in list(sig.parameters.values())[1:]:  # past self
        fields.append((p.name, hints[p.name]) if p.default is p.empty else (p.name, hints[p.name], p.default))
    args = msgspec.defstruct(name, fields, tag=name, module=__name__)
    return Op(name, owner, result, args, sig, inspect.getdoc(fn), **extra)


def _adopt_args(kw: dict[str, Any]) -> dict[str, Any]:
    return {**kw, "payload": payload.decode(kw["payload"])}


def _exported(got: tuple[list[int], Any] | None) -> tuple[list[int], Any] | None:
    # The payload stays wire-encoded on the engine's side: it goes back to a worker's
    # adopt (or across Ray to another replica's) as it is.
    return None if got is None else (got[0], payload.encode(got[1]))


_EX, _W = ExecutorInterface, WorkerControl
OPS: tuple[Op, ...] = (
    _op(_EX, "lease_prefix", Lease | None),
    _op(_EX, "release_lease", None),
    _op(_EX, "adopt", Lease, decode_args=_adopt_args),
    _op(_EX, "register_logit_bias", int),
    _op(_EX, "release_logit_bias", None),
    _op(_EX, "register_token_rules", int),
    _op(_EX, "release_token_rules", None),
    _op(_EX, "compile_grammar", int),
    _op(_EX, "grammar_states", list[tuple[int, str]]),
    _op(_EX, "release_grammar", None),
    _op(_EX, "load_strategy", int),
    _op(_EX, "inject_fault", None),
    _op(_EX, "export_entries", list[int]),
    _op(_EX, "import_entries", list[int]),
    _op(_EX, "export_prefix", tuple[list[int], Any] | None, encode_result=_exported),
    _op(_W, "describe", RuntimeDesc),
    _op(_W, "attach_rings", None),
    _op(_W, "fail_runtime", None),
    _op(_W, "stats", dict[str, Any]),
)
BY_NAME: dict[str, Op] = {op.name: op for op in OPS}
BY_ARGS: dict[type, Op] = {op.args: op for op in OPS}


def operations(owner: type) -> list[str]:
    """The names of a Protocol's operations (run_tick is the tick, not an operation)."""
    return [n for n, v in vars(owner).items() if inspect.isfunction(v) and not n.startswith("_") and n != "run_tick"]


# Every operation of both Protocols is in the table, and nothing else: a method added
# to a Protocol fails here, at import, until the table says how it crosses.
for _owner in (_EX, _W):
    _missing = set(operations(_owner)) ^ {op.name for op in OPS if op.owner is _owner}
    if _missing:
        raise TypeError(f"worker/ops.py and {_owner.__name__} disagree on {sorted(_missing)}")
