"""Commit and CommitJob requests too large for one message, received in chunks
(CommitStream, CommitJobStream; proto/fastpersist.proto: "Large requests").

A Commit's tree and tensor names and a CommitJob's manifest grow with the
job (a 70B model's manifest at 16,384 ranks is 71 MB, a 405B one's at 1,024
ranks 550 MB). As unary requests they needed gRPC's message limit raised to
64 MiB, which refused larger jobs and let any client make the daemon receive
64 MiB before its handler could look at it (transport.py). Streamed, the
first chunk (the request without its large fields) is checked before any
of the payload is read, the payload is bounded by MAX_PAYLOAD_BYTES rather
than by gRPC, and what all calls hold of payloads at once by PAYLOAD_BUDGET:
a stream waits for room before it is read, which is flow control's
backpressure on its client.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from .._proto import fastpersist_pb2 as pb
from ..format.bounds import MAX_MANIFEST_BYTES
from .registry import Registry
from .requests import RequestError, invalid

# A payload: at most the largest manifest fastpersist reads (format/bounds.py).
MAX_PAYLOAD_BYTES = MAX_MANIFEST_BYTES
# Payloads held at once over all calls: one of the largest, or several smaller.
PAYLOAD_BUDGET = MAX_PAYLOAD_BYTES
# A data chunk (the client library sends 1 MiB ones).
MAX_CHUNK = 4 << 20
# A unary Commit's or CommitJob's large fields: above this a client streams.
UNARY_PAYLOAD_BYTES = 4 << 20

Request = TypeVar("Request", pb.CommitRequest, pb.CommitJobRequest)


class _Room:
    """The payload bytes that calls hold at once, within PAYLOAD_BUDGET."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.cond = threading.Condition()

    def take(self, nbytes: int, alive: Callable[[], bool]) -> None:
        with self.cond:
            while self.held + nbytes > self.budget:
                if not alive():
                    raise RequestError("CANCELLED", "the call ended while it waited for room")
                self.cond.wait(1.0)
            self.held += nbytes

    def give(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


_room = _Room(PAYLOAD_BUDGET)


def commit_request(chunks: Iterator[pb.CommitChunk], r: Registry,
                   alive: Callable[[], bool]) -> pb.CommitRequest:
    """A CommitStream's request, whole; its checkpoint is checked first."""
    def check(header: pb.CommitRequest) -> None:
        with r.cond:
            r.require_receiving(r.get(header.checkpoint_id), "commit")

    return _receive(chunks, pb.CommitRequest, ("tree_json", "tensor_order"), check, alive)


def commit_job_request(chunks: Iterator[pb.CommitJobChunk], r: Registry,
                       alive: Callable[[], bool]) -> pb.CommitJobRequest:
    """A CommitJobStream's request, whole; its job is checked first."""
    def check(header: pb.CommitJobRequest) -> None:
        with r.cond:
            r.require_open(r.get_job(header.job_id))

    return _receive(chunks, pb.CommitJobRequest, ("manifest", "files"), check, alive)


def _receive(chunks: Iterator[Any], kind: type[Request], large: tuple[str, ...],
             check: Callable[[Request], None], alive: Callable[[], bool]) -> Request:
    method = "CommitStream" if kind is pb.CommitRequest else "CommitJobStream"
    first = next(chunks, None)
    if first is None or first.WhichOneof("part") != "header":
        raise invalid(f"a {method} must start with a header chunk")
    header, length = first.header, first.payload_length
    if any(name in large for name in _set_fields(header)):
        raise invalid(f"a {method}'s header carries no {' or '.join(large)}: the payload does")
    if length > MAX_PAYLOAD_BYTES:
        raise RequestError("RESOURCE_EXHAUSTED",
                           f"{method} payloads are limited to {MAX_PAYLOAD_BYTES} bytes; this "
                           f"one announces {length}")
    check(header)
    _room.take(length, alive)
    try:
        data = bytearray()
        for chunk in chunks:
            if chunk.WhichOneof("part") != "data":
                raise invalid(f"only data chunks may follow a {method}'s header chunk")
            if len(chunk.data) > MAX_CHUNK:
                raise invalid(f"a data chunk of {len(chunk.data)} bytes is over the "
                              f"{MAX_CHUNK}-byte limit")
            if len(data) + len(chunk.data) > length:
                raise invalid(f"the payload holds more than the {length} bytes announced")
            data += chunk.data
        if len(data) != length:
            raise invalid(f"the payload ended after {len(data)} of the {length} bytes announced")
        payload = kind()
        try:
            payload.ParseFromString(memoryview(data))
        except DecodeError as exc:
            raise invalid(f"the payload is not a serialized {kind.__name__}: {exc}") from None
        del data
        stray = [name for name in _set_fields(payload) if name not in large]
        if stray:
            raise invalid(f"the payload may hold {' and '.join(large)} only, not {stray[0]}")
        payload.MergeFrom(header)  # the small fields into the large: no copy of the payload
        return payload
    finally:
        _room.give(length)


def _set_fields(message: Any) -> list[str]:
    return [field.name for field, _ in message.ListFields()]
