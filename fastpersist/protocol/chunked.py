"""Requests sent to fastpersistd in chunks: a data file's bytes (SubmitStream),
and a Commit or CommitJob whose tree, names or manifest are too large for
one message (CommitStream, CommitJobStream; proto/fastpersist.proto: "Large
requests").

Torch-free (fpctl daemon status uses the client).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import grpc

from .._proto import fastpersist_pb2 as pb

# A SubmitStream data chunk. gRPC and protobuf hold several copies of each
# message in flight in the daemon: 1 MiB chunks keep a stream's share of the
# daemon's memory near 8 MiB (4 MiB ones took ~30), at the same throughput.
CHUNK = 1 << 20
# A Commit's or CommitJob's large fields (tree and names, manifest and files)
# above this are streamed in CHUNKs: the daemon takes no larger unary one
# (daemon/large_requests.py). A streamed one gets its call's timeout and a
# second more for each STREAM_RATE bytes.
UNARY_PAYLOAD_BYTES = 4 << 20
STREAM_RATE = 64 << 20
# A data file's header above this goes out of its SubmitShm or SubmitStream
# message, to a daemon with the LARGE_HEADERS feature: in a shared-memory
# segment, or in the stream's first chunks. gRPC receives a unary message
# whole before the daemon can look at it, so the daemon bounds these messages
# by this (daemon/transport.py); headers of up to 32 MiB (a file of 200,000
# tensors) need not raise that bound for every client.
INLINE_HEADER_BYTES = 1 << 20
LARGE_HEADERS = "large-headers"

Large = TypeVar("Large", pb.CommitRequest, pb.CommitJobRequest)


def send_large(unary: Callable[..., Any], stream: Callable[..., Any],
               chunk: Callable[..., Any], header: Large, payload: Large,
               timeout: float) -> Any:
    """A Commit or CommitJob (`unary`, or `stream` with messages made by
    `chunk`): `header` holds the small fields, `payload` the large ones;
    streamed when they are over UNARY_PAYLOAD_BYTES. grpc.RpcError as the
    calls raise it."""
    data = payload.SerializeToString()
    if len(data) > UNARY_PAYLOAD_BYTES:
        def chunks() -> Iterator[Any]:
            yield chunk(header=header, payload_length=len(data))
            view = memoryview(data)
            for start in range(0, len(data), CHUNK):
                yield chunk(data=bytes(view[start:start + CHUNK]))

        try:
            return stream(chunks(), timeout=timeout + len(data) / STREAM_RATE)
        except grpc.RpcError as exc:
            # A daemon older than the streams takes the unary call, up to the
            # 64 MiB its gRPC limit allows.
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
    header.MergeFrom(payload)
    return unary(header, timeout=timeout)


def submit_messages(ident: str, index: int, header: bytes, length: int,
                    chunks: Iterable[bytes | memoryview], header_in_parts: bool
                    ) -> Iterator[pb.StreamChunk]:
    """A SubmitStream's messages: the file, its header in the first one or
    (header_in_parts) in data chunks of their own, then the data section's
    bytes in CHUNKs."""
    file = pb.DataFile(index=index, header=b"" if header_in_parts else header)
    yield pb.StreamChunk(header=pb.StreamHeader(
        checkpoint_id=ident, file=file, data_length=length,
        header_length=len(header) if header_in_parts else 0))
    if header_in_parts:
        for start in range(0, len(header), CHUNK):
            yield pb.StreamChunk(data=header[start:start + CHUNK])
    for chunk in chunks:
        for start in range(0, len(chunk), CHUNK):
            yield pb.StreamChunk(data=bytes(chunk[start:start + CHUNK]))
