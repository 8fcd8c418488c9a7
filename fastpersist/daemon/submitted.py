"""What a SubmitShm or SubmitStream brings besides its request message: a data
file's header sent out of the message, and a stream's data chunks.

A header over protocol/chunked.py's INLINE_HEADER_BYTES (up to 32 MiB) does not
come in the message: gRPC receives a unary message whole before any handler
sees it, so the bound on these messages (transport.py) would otherwise have to
let every client send 32 MiB ones. It comes instead

- in a shared-memory segment of the client's (SubmitShmRequest.header_ref),
  sealed with the checkpoint's tag like the data's segment: copied out during
  the call;
- or in a SubmitStream's first data chunks (StreamHeader.header_length),
  received as the handler reads them.

Callers hold a parse turn (budgets.parsing) for the header's size while
taking and parsing it, so that few large headers are in memory at once.
"""

from __future__ import annotations

from collections.abc import Iterator

from .._proto import fastpersist_pb2 as pb
from ..protocol import shm
from .registry import Registry
from .requests import MAX_HEADER_BYTES, MAX_STREAM_CHUNK, invalid


def header_size(inline: bytes, out_of_message: int) -> int:
    """The header's size, refused if it is both in the message and out of
    it, or over MAX_HEADER_BYTES, before any of it is taken."""
    if inline and out_of_message:
        raise invalid("a data file's header goes in the request or out of it, not both")
    if out_of_message > MAX_HEADER_BYTES:
        raise invalid(f"a data file's header of {out_of_message} bytes is over the "
                      f"{MAX_HEADER_BYTES}-byte limit")
    return out_of_message or len(inline)


def shm_header(request: pb.SubmitShmRequest, shm_fd: int) -> bytes:
    """SubmitShm's header: in the message, or in the segment header_ref names,
    which must carry the checkpoint's tag (shm.open_range)."""
    if not request.HasField("header_ref"):
        return request.file.header
    ref = request.header_ref
    if not ref.length:  # else read as an empty header, refused later without a reason
        raise invalid("header_ref names an empty header: leave it unset to send the "
                      "header in the request")
    mapping = shm.open_range(shm_fd, ref.segment, ref.offset, ref.length,
                             shm.tag_for(request.checkpoint_id))
    try:
        return bytes(mapping.view)
    finally:
        mapping.close()


def stream_header(head: pb.StreamHeader, chunks: Iterator[memoryview], registry: Registry
                  ) -> bytes:
    """SubmitStream's header: in its first message, or (header_length) in the
    data chunks that follow it, taken only for a checkpoint that is receiving."""
    if not head.header_length:
        return head.file.header
    with registry.cond:
        registry.require_receiving(registry.get(head.checkpoint_id), "submit a file to")
    parts: list[memoryview] = []
    taken = 0
    while taken < head.header_length:
        chunk = next(chunks, None)
        if chunk is None:
            raise invalid(f"the stream ended after {taken} of its header's "
                          f"{head.header_length} bytes")
        taken += len(chunk)
        if taken > head.header_length:
            raise invalid(f"a data chunk runs {taken - head.header_length} bytes past the "
                          "header's end (the header's last chunk must end where it does)")
        parts.append(chunk)
    return b"".join(parts)


def data_chunks(chunks: Iterator[pb.StreamChunk]) -> Iterator[memoryview]:
    """A SubmitStream's messages after its first: data chunks, each bounded."""
    for chunk in chunks:
        if chunk.WhichOneof("part") != "data":
            raise invalid("only data chunks may follow the header chunk")
        if len(chunk.data) > MAX_STREAM_CHUNK:
            raise invalid(f"a data chunk of {len(chunk.data)} bytes is over the "
                          f"{MAX_STREAM_CHUNK}-byte limit")
        yield memoryview(chunk.data)
