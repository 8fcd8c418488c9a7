"""Replicate's hand-written data chunks are protobuf's wire format (replica_wire.py).

A sender of this version talks to a receiver that parses with protobuf and
back, so encode_data must give SerializeToString's bytes, and decode_chunk
must read whatever a protobuf encoder writes (fields in any order, unknown
ones, a oneof written twice) as protobuf reads it.
"""

from __future__ import annotations

import random

import pytest

from fastpersist._proto import fastpersist_pb2 as pb
from fastpersist.daemon.replica_wire import Data, decode_chunk, encode_chunk, encode_data


def _cases() -> list[tuple[int, int, bytes, int]]:
    r = random.Random(35)
    out = [(0, 0, b"", 0), (0, 0, b"x", 0), (1, 0, b"ab", 1), (0, 4 << 20, b"z" * 300, 0),
           (2**32 - 1, 2**64 - 1, b"\x00" * 129, 2**32 - 1)]
    for _ in range(50):
        out.append((r.randrange(2**32), r.randrange(2**40), r.randbytes(r.randrange(0, 5000)),
                    r.randrange(2**32)))
    return out


@pytest.mark.parametrize("case", _cases())
def test_encode_is_protobufs_encoding(case: tuple[int, int, bytes, int]) -> None:
    file, offset, data, crc = case
    expected = pb.ReplicaChunk(data=pb.ReplicaData(file=file, offset=offset, data=data,
                                                   crc32c=crc)).SerializeToString()
    assert encode_data(file, offset, memoryview(data), crc) == expected
    got = decode_chunk(expected)
    assert isinstance(got, Data)
    assert (got.file, got.offset, bytes(got.data), got.crc32c) == (file, offset, data, crc)


def test_decode_reads_any_field_order_and_skips_unknown_fields() -> None:
    def key(number: int, kind: int) -> bytes:
        return bytes([number << 3 | kind])

    inner = (key(4, 5) + (0xDEADBEEF).to_bytes(4, "little")  # crc32c first
             + key(9, 2) + b"\x03abc"  # an unknown length-delimited field
             + key(3, 2) + b"\x04data" + key(2, 0) + b"\x96\x01"  # offset 150
             + key(10, 0) + b"\x05" + key(11, 1) + b"\x00" * 8 + key(1, 0) + b"\x07")
    message = key(2, 2) + bytes([len(inner)]) + inner
    want = pb.ReplicaChunk.FromString(message).data
    got = decode_chunk(message)
    assert isinstance(got, Data)
    assert (got.file, got.offset, bytes(got.data), got.crc32c) == \
        (want.file, want.offset, want.data, want.crc32c) == (7, 150, b"data", 0xDEADBEEF)


def test_headers_and_everything_else_go_to_protobuf() -> None:
    header = pb.ReplicaChunk(header=pb.ReplicaHeader(job="j", node="n", path="a/b"))
    got = decode_chunk(header.SerializeToString())
    assert isinstance(got, pb.ReplicaChunk) and got.header.path == "a/b"
    assert encode_chunk(header) == header.SerializeToString()
    # A data chunk, then a header: the oneof's last field wins, as in protobuf.
    both = encode_data(1, 2, b"xy", 3) + header.SerializeToString()
    got = decode_chunk(both)
    assert isinstance(got, pb.ReplicaChunk) and got.WhichOneof("part") == "header"
    # Two data chunks in one message: protobuf merges them; so does the fallback.
    two = encode_data(1, 2, b"xy", 3) + encode_data(0, 0, b"zz", 0)
    got = decode_chunk(two)
    want = pb.ReplicaChunk.FromString(two).data
    assert isinstance(got, Data) and bytes(got.data) == want.data == b"zz" and got.file == 1
    assert isinstance(decode_chunk(b""), pb.ReplicaChunk)


def test_malformed_data_chunks_are_refused_as_protobuf_refuses_them() -> None:
    good = encode_data(1, 2, b"abcdef", 3)
    for bad in (good[:-3], good[:2] + b"\xff" * 12, b"\x12\x05\x1a\x09abc"):
        with pytest.raises(Exception) as caught:
            pb.ReplicaChunk.FromString(bad)
        with pytest.raises(type(caught.value)):
            decode_chunk(bad)
