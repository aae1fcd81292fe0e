"""Messages between the engine and its worker: msgpack (msgspec), length-framed.

Engine -> worker: ``Call`` (an executor operation) or ``Tick`` (a plan).
Worker -> engine: ``Partial`` (a token picked inside a running tick, when asked),
then exactly one ``Reply`` per request. No pickle anywhere on this path.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec

from ..abi import TickOutcome, TickPlan


class Tick(msgspec.Struct, tag="tick"):
    plan: TickPlan
    partial: bool = False


class Call(msgspec.Struct, tag="call"):
    op: str
    args: list[Any] = []


class Partial(msgspec.Struct, tag="partial"):
    lane_tag: int
    token: int


class Reply(msgspec.Struct, tag="reply"):
    value: Any = None
    outcome: TickOutcome | None = None
    error: str | None = None
    error_kind: str | None = None  # "ValueError", "GrammarError", "KeyError", "PrimError", ...


ToWorker = Tick | Call
ToEngine = Partial | Reply

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


def decode_to_worker(frame: bytes) -> Tick | Call:
    return _to_worker.decode(frame)


def decode_to_engine(frame: bytes) -> Partial | Reply:
    return _to_engine.decode(frame)
