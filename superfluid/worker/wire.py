"""Messages between the engine and its worker: msgpack (msgspec), length-framed.

Engine -> worker: ``Tick`` (a plan) or one operation's arguments (a struct of
ops.OPS, tagged with the operation's name).
Worker -> engine: ``Partial`` (a token picked inside a running tick, when asked),
then exactly one answer per request: ``TickReply``, ``Reply`` (an operation's result,
read as that operation's result type) or ``Failed`` (errors.py). No pickle anywhere
on this path.
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Union

import msgspec

from ..abi import PartialEmit, TickOutcome, TickPlan
from . import ops
from .errors import Failed


class Tick(msgspec.Struct, tag="tick"):
    plan: TickPlan
    partial: bool = False


class Partial(msgspec.Struct, tag="partial"):
    emit: PartialEmit


class TickReply(msgspec.Struct, tag="tick_reply"):
    outcome: TickOutcome


class Reply(msgspec.Struct, tag="reply"):
    value: Any = None


ToWorker = Union[(Tick, *(op.args for op in ops.OPS))]
ToEngine = Partial | TickReply | Reply | Failed

_HEADER = struct.Struct("<I")
_enc = msgspec.msgpack.Encoder()
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_engine = msgspec.msgpack.Decoder(ToEngine)


class WireClosed(Exception):
    pass


def send(sock: socket.socket, msg: msgspec.Struct) -> None:
    body = _enc.encode(msg)
    sock.sendall(_HEADER.pack(len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = sock.recv(n - got)
        if not b:
            raise WireClosed("the peer closed the connection")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, n)


def decode_to_worker(frame: bytes) -> Any:
    """A ``Tick`` or an operation's arguments; msgspec.ValidationError for a frame
    that is neither (an unknown operation, arguments of the wrong types)."""
    return _to_worker.decode(frame)


def decode_to_engine(frame: bytes) -> Partial | TickReply | Reply | Failed:
    return _to_engine.decode(frame)
