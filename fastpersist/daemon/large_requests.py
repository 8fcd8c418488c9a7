"""Commit and CommitJob requests too large for one message, received in chunks
(CommitStream, CommitJobStream; proto/fastpersist.proto: "Large requests").

A Commit's tree and tensor names and a CommitJob's manifest grow with the
job (a 70B model's manifest at 16,384 ranks is 71 MB, a 405B one's at 1,024
ranks 550 MB). As unary requests they needed gRPC's message limit raised to
64 MiB, which refused larger jobs and let any client make the daemon receive
64 MiB before its handler could look at it (transport.py). Streamed, the
first chunk (the request without its large fields) is checked before any
of the payload is read, the payload is bounded by MAX_PAYLOAD_BYTES rather
than by gRPC, and what all calls hold of payloads at once, received or being
handled, by PAYLOAD_BUDGET: a stream waits for room before it is read, which
is flow control's backpressure on its client. Handling a payload takes more
than its size (checking a 62 MiB manifest raised the daemon's peak RSS by
317 MiB, as it did as a unary request): the budget keeps that to one
budget's worth of payloads at a time.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from .._proto import fastpersist_pb2 as pb
from ..format.bounds import MAX_MANIFEST_BYTES
from . import logs
from .registry import Registry
from .requests import MAX_STREAM_CHUNK, RequestError, invalid

# A payload: at most the largest manifest fastpersist reads (format/bounds.py).
MAX_PAYLOAD_BYTES = MAX_MANIFEST_BYTES
# Payloads held at once over all calls: one of the largest, or several smaller.
PAYLOAD_BUDGET = MAX_PAYLOAD_BYTES

Request = TypeVar("Request", pb.CommitRequest, pb.CommitJobRequest)


class Room:
    """The payload bytes that calls hold at once, within PAYLOAD_BUDGET.
    Calls take room in the order they asked for it: a large payload waiting
    for room is not overtaken, for ever, by smaller ones that would fit."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.held = 0
        self.cond = threading.Condition()
        self.waiting: collections.deque[object] = collections.deque()  # in order of asking

    def take(self, nbytes: int, alive: Callable[[], bool]) -> None:
        with self.cond:
            me = object()
            self.waiting.append(me)
            try:
                while self.waiting[0] is not me or self.held + nbytes > self.budget:
                    if not alive():
                        raise RequestError("CANCELLED",
                                           "the call ended while it waited for room")
                    self.cond.wait(1.0)  # given room wakes it; a call's end, within 1 s
                self.held += nbytes
            finally:
                self.waiting.remove(me)
                self.cond.notify_all()  # the next in line may fit now

    def give(self, nbytes: int) -> None:
        with self.cond:
            self.held -= nbytes
            self.cond.notify_all()


class _Receiving:
    """A payload being received: when its last chunk came, how to cancel it,
    and the event that says it stalled."""

    def __init__(self, cancel: Callable[[], None], event: str = "commit-stream-stalled") -> None:
        self.cancel, self.event = cancel, event
        self.last_chunk: float | None = time.monotonic()


_receiving: set[_Receiving] = set()  # under _room.cond


def reap_stalled(now: float, timeout: float) -> None:
    """Cancel the payload streams that sent nothing for `timeout` seconds
    (--idle-timeout): a client that announces a payload and stalls must not
    hold the budget's room, and others' commits, for ever."""
    with _room.cond:
        for receiving in list(_receiving):
            last = receiving.last_chunk
            if last is not None and now - last > timeout:
                logs.warning(receiving.event, seconds=round(now - last))
                receiving.last_chunk = None  # cancelled once
                receiving.cancel()


_room = Room(PAYLOAD_BUDGET)


@contextlib.contextmanager
def stall_watch(cancel: Callable[[], None], event: str) -> Iterator[Callable[[], None]]:
    """Watch another stream that holds room (a Replicate's manifest,
    replica_manifest.py) as the payload streams are: reap_stalled cancels it
    when it sends nothing for --idle-timeout, logging `event`. Call the
    function yielded on every chunk it sends."""
    receiving = _Receiving(cancel, event)

    def touch() -> None:
        if receiving.last_chunk is not None:  # (None: cancelled)
            receiving.last_chunk = time.monotonic()

    with _room.cond:
        _receiving.add(receiving)
    try:
        yield touch
    finally:
        with _room.cond:
            _receiving.discard(receiving)


def commit_request(chunks: Iterator[pb.CommitChunk], r: Registry, alive: Callable[[], bool],
                   cancel: Callable[[], None]) -> AbstractContextManager[pb.CommitRequest]:
    """A CommitStream's request, whole, held within PAYLOAD_BUDGET until
    the context ends; its checkpoint is checked first."""
    def check(header: pb.CommitRequest) -> None:
        with r.cond:
            r.require_receiving(r.get(header.checkpoint_id), "commit")

    return _receive(chunks, pb.CommitRequest, ("tree_json", "tensor_order"), check, alive,
                    cancel)


def commit_job_request(chunks: Iterator[pb.CommitJobChunk], r: Registry,
                       alive: Callable[[], bool], cancel: Callable[[], None]
                       ) -> AbstractContextManager[pb.CommitJobRequest]:
    """commit_request for a CommitJobStream; its job is checked first."""
    def check(header: pb.CommitJobRequest) -> None:
        with r.cond:
            r.require_open(r.get_job(header.job_id))

    return _receive(chunks, pb.CommitJobRequest, ("manifest", "files"), check, alive, cancel)


@contextlib.contextmanager
def _receive(chunks: Iterator[Any], kind: type[Request], large: tuple[str, ...],
             check: Callable[[Request], None], alive: Callable[[], bool],
             cancel: Callable[[], None]) -> Iterator[Request]:
    method = "CommitStream" if kind is pb.CommitRequest else "CommitJobStream"
    first = next(chunks, None)
    if first is None or first.WhichOneof("part") != "header":
        raise invalid(f"a {method} must start with a header chunk")
    header: Request = first.header
    length: int = first.payload_length
    if any(name in large for name in _set_fields(header)):
        raise invalid(f"a {method}'s header carries no {' or '.join(large)}: the payload does")
    if length > MAX_PAYLOAD_BYTES:
        raise RequestError("RESOURCE_EXHAUSTED",
                           f"{method} payloads are limited to {MAX_PAYLOAD_BYTES} bytes; this "
                           f"one announces {length}")
    check(header)
    _room.take(length, alive)
    try:
        # Anonymous pages, touched as the chunks arrive: a stream that
        # announces much and sends little holds little, and the payload is
        # never copied to grow (a bytearray's reallocations held it twice).
        buffer = mmap.mmap(-1, max(length, 1))
        receiving = _Receiving(cancel)
        with _room.cond:
            _receiving.add(receiving)
        try:
            request = _parse(chunks, buffer, length, kind, large, method, header, receiving)
        finally:
            with _room.cond:
                _receiving.discard(receiving)
            buffer.close()
        yield request  # (its handler runs within the budget: parsing it takes more)
    finally:
        _room.give(length)


def _parse(chunks: Iterator[Any], buffer: mmap.mmap, length: int, kind: type[Request],
           large: tuple[str, ...], method: str, header: Request,
           receiving: _Receiving) -> Request:
    received = 0
    for chunk in chunks:
        if chunk.WhichOneof("part") != "data":
            raise invalid(f"only data chunks may follow a {method}'s header chunk")
        n = len(chunk.data)
        if n > MAX_STREAM_CHUNK:
            raise invalid(f"a data chunk of {n} bytes is over the {MAX_STREAM_CHUNK}-byte limit")
        if received + n > length:
            raise invalid(f"the payload holds more than the {length} bytes announced")
        buffer[received:received + n] = chunk.data
        received += n
        if receiving.last_chunk is not None:  # (None: cancelled)
            receiving.last_chunk = time.monotonic()
    if received != length:
        raise invalid(f"the payload ended after {received} of the {length} bytes announced")
    payload = kind()
    with memoryview(buffer) as view, view[:length] as data:
        try:
            payload.ParseFromString(data)
        except DecodeError as exc:
            raise invalid(f"the payload is not a serialized {kind.__name__}: {exc}") from None
    stray = [name for name in _set_fields(payload) if name not in large]
    if stray:
        raise invalid(f"the payload may hold {' and '.join(large)} only, not {stray[0]}")
    payload.MergeFrom(header)  # the small fields into the large: no copy of the payload
    return payload


def _set_fields(message: Any) -> list[str]:
    return [field.name for field, _ in message.ListFields()]
