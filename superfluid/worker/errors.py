"""Errors of the worker, and errors that cross its socket as typed values.

An operation that raises in the worker answers ``Failed``: a kind, the message, and a
fault's code. The engine's side raises the same class again (``exception``), so a
caller catches what it would catch from an executor in its own process: ValueError
(GrammarError among them), KeyError, or the runtime's PrimError subclass. Anything
else an operation raises is a bug in that operation (``OperationFailed``); the worker
goes on serving.
"""

from __future__ import annotations

import enum

import msgspec

from ..executor.grammar_errors import GrammarError
from ..executor.interface import ExecutorLost
from ..runtimes.base import Capacity, Fatal, Fault, OutOfBoundary, PrimError, UnknownSeq, Unsupported


class WorkerLost(ExecutorLost):
    """The worker died, exited, stopped beating or stopped making progress."""

    def __init__(self, why: str, exit_code: int | None = None):
        super().__init__(why)
        self.exit_code = exit_code


class WorkerFailed(Exception):
    """The worker cannot be (re)started: the model does not load, or restarts ran out."""


class OperationFailed(RuntimeError):
    """An operation raised something it does not promise (a bug in it); the message
    names the operation and the exception."""


class ErrorKind(enum.Enum):
    VALUE = "value"
    KEY = "key"
    GRAMMAR = "grammar"
    PRIM = "prim"
    FAULT = "fault"
    CAPACITY = "capacity"
    FATAL = "fatal"
    UNSUPPORTED = "unsupported"
    UNKNOWN_SEQ = "unknown_seq"
    OUT_OF_BOUNDARY = "out_of_boundary"
    LOAD = "load"  # the worker's runtime did not load: WorkerFailed
    INTERNAL = "internal"  # anything else: OperationFailed


class Failed(msgspec.Struct, tag="failed"):
    kind: ErrorKind
    message: str
    code: int = 0  # a Fault's code


# The classes that cross as themselves. A subclass not named here crosses as its
# nearest named base (a msgspec.ValidationError as a ValueError).
_CLASSES: dict[ErrorKind, type[Exception]] = {
    ErrorKind.VALUE: ValueError,
    ErrorKind.KEY: KeyError,
    ErrorKind.GRAMMAR: GrammarError,
    ErrorKind.PRIM: PrimError,
    ErrorKind.FAULT: Fault,
    ErrorKind.CAPACITY: Capacity,
    ErrorKind.FATAL: Fatal,
    ErrorKind.UNSUPPORTED: Unsupported,
    ErrorKind.UNKNOWN_SEQ: UnknownSeq,
    ErrorKind.OUT_OF_BOUNDARY: OutOfBoundary,
    ErrorKind.LOAD: WorkerFailed,
    ErrorKind.INTERNAL: OperationFailed,
}
_KINDS = {cls: kind for kind, cls in _CLASSES.items() if kind not in (ErrorKind.LOAD, ErrorKind.INTERNAL)}


def failure(op: str, e: Exception) -> Failed:
    """The worker's answer for an operation that raised ``e``."""
    for cls in type(e).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            return Failed(kind, str(message), getattr(e, "code", 0) if kind is ErrorKind.FAULT else 0)
    return Failed(ErrorKind.INTERNAL, f"{op} failed inside the worker: {type(e).__name__}: {e}")


def exception(failed: Failed) -> Exception:
    """The exception the engine's side raises for ``failed``: the class it was raised as."""
    cls = _CLASSES[failed.kind]
    if cls is Fault:
        return Fault(failed.code, failed.message)
    return cls(failed.message)
