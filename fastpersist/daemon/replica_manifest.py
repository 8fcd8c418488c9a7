"""A Replicate's manifest: in the header when small, in bounded parts after it when not.

A job's manifest grows with its ranks and tensors (71 MB for a 70B model
saved by 16,384 ranks) and the format reads up to 1 GiB (format/bounds.py),
but a gRPC message is at most 64 MiB (transport.MAX_MESSAGE_BYTES), and the
header used to hold the whole manifest: such a checkpoint was never
replicated (the sender's "Sent message larger than max", every round).

So, as CommitStream did for commits: a manifest over INLINE_MAX goes as
ReplicaHeader{manifest_bytes: its length, manifest: empty}, then
ReplicaChunk{manifest: part} messages of at most PART bytes, then the data
chunks. The receiver checks the announced length against the format's bound
before it reads a part, and every part against what is left, so a broken or
hostile peer costs it at most MAX_MANIFEST_BYTES however it lies; and the
announced manifests of all Replicate calls at once are held within one such
budget (room(): checking a manifest takes several times its size, 267 MiB for
a 70 MB one), a call waiting for room before it reads a part.

A manifest up to INLINE_MAX still goes in the header (the old form), which
every receiver takes: a new sender replicates small manifests to an old
daemon as before. An old daemon given a header with manifest_bytes refuses
it (its manifest field is empty: INVALID_ARGUMENT, "must be a valid one");
the sender then sends it again in the header if it fits in one message
(OLD_INLINE_MAX, as older senders did), and otherwise logs the refusal with
OLD_PEER_HINT: the round counts as short (replication-short, then
replication-given-up), never as a copy.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import grpc

from .._proto import fastpersist_pb2 as pb
from ..format.bounds import MAX_MANIFEST_BYTES
from .large_requests import Room, stall_watch
from .replica_wire import Data
from .requests import invalid

INLINE_MAX = 16 << 20  # in the header, as every version sends and takes it
PART = 4 << 20  # a manifest part, as the data chunks
# The largest manifest an older peer takes in the header: gRPC's 64 MiB
# message (transport.MAX_MESSAGE_BYTES), less room for the file list.
OLD_INLINE_MAX = 60 << 20
OLD_PEER_HINT = ("the peer may be a fastpersistd older than this one, which takes a "
                 f"replica's manifest of at most {OLD_INLINE_MAX >> 20} MiB; upgrade it")


def older_peer_refused(error: grpc.RpcError, manifest_bytes: int, inline_max: int) -> bool:
    """Whether `error` is an older peer's refusal of a manifest sent in parts
    (it read the header's empty manifest field as the manifest)."""
    return manifest_bytes > inline_max and error.code() == grpc.StatusCode.INVALID_ARGUMENT \
        and "manifest must be a valid one" in (error.details() or "")


_room = Room(MAX_MANIFEST_BYTES)  # the streamed manifests of all Replicate calls


Chunks = Iterator[pb.ReplicaChunk | Data]


@contextlib.contextmanager
def room(header: pb.ReplicaHeader, chunks: Chunks, context: grpc.ServicerContext
         ) -> Iterator[tuple[Chunks, Callable[[], None]]]:
    """Hold room for the manifest `header` announces while the call receives
    and checks it, the call cancelled if it sends nothing for --idle-timeout
    (large_requests.stall_watch: a peer that announces 1 GiB and stalls must
    not hold the room for ever); yields the call's chunks and what gives the
    room back (once the manifest is in the replica's file, counted in
    --replica-bytes: the data that follows may take minutes, and other
    peers' manifests would wait for it). Nothing for a manifest in the header
    (gRPC bounds it) or one over the limit (receive refuses it unread)."""
    declared = header.manifest_bytes
    if not 0 < declared <= MAX_MANIFEST_BYTES:
        yield chunks, lambda: None
        return
    _room.take(declared, context.is_active)
    held = [declared]

    def give_back() -> None:
        if held:
            _room.give(held.pop())

    try:
        with stall_watch(context.cancel, "replica-manifest-stalled") as touch:
            yield _touching(chunks, touch), give_back
    finally:
        give_back()


def _touching(chunks: Chunks, touch: Callable[[], None]) -> Chunks:
    for chunk in chunks:
        touch()
        yield chunk


def data_only(chunks: Chunks) -> Iterator[Data]:
    """The data chunks that follow a Replicate's header and manifest."""
    for chunk in chunks:  # transport.py decodes data chunks as Data (replica_wire.py)
        if not isinstance(chunk, Data):
            raise invalid("only data chunks may follow a Replicate's header chunk")
        yield chunk


def header_and_parts(header: pb.ReplicaHeader, manifest: bytes, inline_max: int = INLINE_MAX
                     ) -> Iterator[pb.ReplicaChunk]:
    """The sender's first messages: the header, with the manifest in it up to
    `inline_max` bytes, else its length in it and the manifest in PART-byte parts."""
    first = pb.ReplicaHeader()
    first.CopyFrom(header)  # the caller's is shared by the sends to its peers
    if len(manifest) <= inline_max:
        first.manifest = manifest
        yield pb.ReplicaChunk(header=first)
        return
    first.manifest_bytes = len(manifest)
    yield pb.ReplicaChunk(header=first)
    view = memoryview(manifest)
    for start in range(0, len(manifest), PART):
        yield pb.ReplicaChunk(manifest=bytes(view[start:start + PART]))


def receive(header: pb.ReplicaHeader, chunks: Chunks) -> bytes:
    """The manifest of a Replicate whose header is `header`: the header's own,
    or the parts that follow it, read from `chunks` up to the announced length
    (RequestError INVALID_ARGUMENT for anything else)."""
    declared = header.manifest_bytes
    if not declared:
        return header.manifest
    if header.manifest:
        raise invalid("a replica header holds a manifest or announces one (manifest_bytes), "
                      "not both")
    if declared > MAX_MANIFEST_BYTES:  # before a byte of it is read
        raise invalid(f"a replica's manifest of {declared} bytes is over the "
                      f"{MAX_MANIFEST_BYTES} this version reads")
    parts: list[bytes] = []
    got = 0
    while got < declared:
        chunk = next(chunks, None)
        if chunk is None:
            raise invalid(f"the Replicate stream ended after {got} of the manifest's "
                          f"{declared} bytes")
        if isinstance(chunk, Data) or chunk.WhichOneof("part") != "manifest":
            raise invalid(f"expected the manifest's part at {got} of {declared} bytes, "
                          "got another kind of chunk")
        part = chunk.manifest  # each access copies it
        n = len(part)
        if not 0 < n <= PART or got + n > declared:
            raise invalid(f"a manifest part of {n} bytes at {got} of {declared}: parts are "
                          f"1 to {PART} bytes and end at the announced length")
        parts.append(part)
        got += n
    return b"".join(parts)


__all__ = ["INLINE_MAX", "OLD_INLINE_MAX", "OLD_PEER_HINT", "PART", "data_only", "header_and_parts",
           "older_peer_refused", "receive", "room"]
