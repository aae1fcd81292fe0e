"""One executor interface: Executor and WorkerClient have the signatures the Protocol
states, the worker's wire is made from them, and errors cross it as their own class."""

import inspect

import msgspec
import pytest

from superfluid.executor import Executor
from superfluid.executor.grammar_errors import GrammarError
from superfluid.executor.interface import ExecutorInterface, ExecutorLost, InProcess, Supervised
from superfluid.runtimes.base import Capacity, Fatal, Fault, OutOfBoundary, PrimError, UnknownSeq, Unsupported
from superfluid.runtimes.toy import ToyRuntime
from superfluid.worker import errors, ops, wire
from superfluid.worker.client import OperationFailed, WorkerClient, WorkerConfig, WorkerLost
from superfluid.worker.main import Worker


def _params(fn) -> list[tuple[str, object, object]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", ["run_tick", *ops.operations(ExecutorInterface)])
@pytest.mark.parametrize("impl", [Executor, WorkerClient])
def test_executor_and_worker_client_have_the_protocols_signatures(impl, name):
    assert _params(getattr(impl, name)) == _params(getattr(ExecutorInterface, name))


def test_both_executors_and_both_supervisors_implement_the_protocols():
    client = WorkerClient(WorkerConfig())  # not started: no process
    try:
        assert isinstance(Executor(ToyRuntime()), ExecutorInterface) and isinstance(client, ExecutorInterface)
        assert isinstance(InProcess(), Supervised) and isinstance(client, Supervised)
    finally:
        client.close()
    assert issubclass(WorkerLost, ExecutorLost)


def test_an_operations_arguments_cross_as_a_struct_made_from_its_signature():
    op = ops.BY_NAME["lease_prefix"]
    args = op.args([1, 2, 3], cache_key=9)
    got = wire.decode_to_worker(msgspec.msgpack.encode(args))
    assert ops.BY_ARGS[type(got)] is op
    assert op.kwargs(got) == dict(prompt=[1, 2, 3], ttl_ticks=4, determinism_class=0, cache_key=9)
    with pytest.raises(msgspec.ValidationError):  # an operation the table does not name
        wire.decode_to_worker(msgspec.msgpack.encode({"type": "no_such_op"}))


@pytest.mark.parametrize("exc", [
    ValueError("bad value"), KeyError("grammar handle 3 is not held"), GrammarError("bad regex"),
    PrimError("prim"), Fault(104, "a fault"), Capacity("no room"), Fatal("gone"), Unsupported("no partial"),
    UnknownSeq("seq 9"), OutOfBoundary("past the end"),
])
def test_errors_cross_as_their_own_class(exc):
    frame = msgspec.msgpack.encode(errors.failure("lease_prefix", exc))
    back = errors.exception(wire.decode_to_engine(frame))
    assert type(back) is type(exc) and str(back) == str(exc)
    if isinstance(exc, Fault):
        assert back.code == exc.code


def test_a_subclass_crosses_as_its_nearest_named_base_and_a_bug_as_an_internal_error():
    assert type(errors.exception(errors.failure("adopt", msgspec.ValidationError("x")))) is ValueError
    failed = errors.failure("stats", AttributeError("'NoneType' object has no attribute 'lanes'"))
    assert failed.kind is errors.ErrorKind.INTERNAL
    back = errors.exception(failed)
    assert type(back) is OperationFailed and "stats" in str(back) and "AttributeError" in str(back)


def test_the_worker_answers_an_unreadable_call_without_dying():
    w = Worker(None, ToyRuntime())  # answer() only reads frames; serve() sends them
    got = w.answer(msgspec.msgpack.encode({"type": "no_such_op"}))
    assert isinstance(got, errors.Failed) and got.kind is errors.ErrorKind.VALUE
    got = w.answer(msgspec.msgpack.encode(ops.BY_NAME["lease_prefix"].args([1, 2])))
    assert isinstance(got, errors.Failed) and "no rings attached" in got.message
