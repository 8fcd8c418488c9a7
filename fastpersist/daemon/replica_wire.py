"""Replicate's data chunks, encoded and decoded without protobuf's copies.

A Replicate stream (replication.py sends, replicas.py receives) is a
ReplicaChunk header, then ReplicaChunk{data: ReplicaData{file, offset,
data, crc32c}} messages of up to 4 MiB each. Through the generated code
each data chunk's bytes were copied four times on the way out (the read
buffer to bytes, into the message, into its serialization) and twice on
the way in (parsing, then every `.data` access), on a 2-vCPU machine where
those copies and grpcio's own were most of replication's time.

Here the sender writes the same wire bytes itself (one join of a small
prefix, the read buffer and the CRC: encode_data) and the receiver reads
a data chunk's fields straight out of the message grpcio hands over,
its bytes a memoryview of it (decode_chunk). The wire format is
unchanged: encode_data's output is what SerializeToString gives for the
same message (tests/test_replica_wire.py), and decode_chunk parses any
valid encoding (fields in any order, unknown ones skipped) and gives
everything that is not a lone data chunk to protobuf as before.

Torch-free: this runs in the daemon.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._proto import fastpersist_pb2 as pb

_CHUNK_DATA = 0x12  # ReplicaChunk field 2 (data), length-delimited


@dataclass
class Data:
    """A ReplicaData as the receiver reads it: `data` views the message."""

    file: int
    offset: int
    data: memoryview
    crc32c: int


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def encode_data(file: int, offset: int, data: memoryview | bytes, crc: int) -> bytes:
    """ReplicaChunk{data: ReplicaData{file, offset, data, crc32c}}'s bytes,
    as protobuf would write them (zero fields left out), in one copy."""
    inner = b"".join((b"\x08" + _varint(file) if file else b"",
                      b"\x10" + _varint(offset) if offset else b"",
                      b"\x1a" + _varint(len(data)) if len(data) else b""))
    tail = b"\x25" + crc.to_bytes(4, "little") if crc else b""
    size = len(inner) + len(data) + len(tail)
    return b"".join((bytes([_CHUNK_DATA]), _varint(size), inner, data, tail))


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if shift > 63:
            raise ValueError("varint too long")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _parse_data(buf: memoryview) -> Data:
    """ReplicaData's fields from its bytes (ValueError/IndexError if malformed)."""
    file = offset = crc = 0
    data = buf[0:0]
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, pos = _read_varint(buf, pos)
            if number == 1:
                file = value & 0xFFFFFFFF
            elif number == 2:
                offset = value
        elif kind == 2:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise ValueError("a field runs past the message")
            if number == 3:
                data = buf[pos:pos + length]
            pos += length
        elif kind == 5:
            if pos + 4 > end:
                raise ValueError("a fixed32 runs past the message")
            if number == 4:
                crc = int.from_bytes(buf[pos:pos + 4], "little")
            pos += 4
        elif kind == 1:
            pos += 8
        else:
            raise ValueError(f"wire type {kind}")
        if pos > end:
            raise ValueError("a field runs past the message")
    return Data(file, offset, data, crc)


def decode_chunk(message: bytes) -> pb.ReplicaChunk | Data:
    """A Replicate message: a lone data chunk as Data (no copy of its bytes),
    anything else (a header, several fields, something malformed) parsed by
    protobuf as before (which raises on what is malformed)."""
    if message[:1] == bytes([_CHUNK_DATA]):
        view = memoryview(message)
        try:
            length, pos = _read_varint(view, 1)
            if pos + length == len(view):
                return _parse_data(view[pos:])
        except (ValueError, IndexError):
            pass
    chunk: pb.ReplicaChunk = pb.ReplicaChunk.FromString(message)
    if chunk.WhichOneof("part") == "data":
        d = chunk.data
        return Data(d.file, d.offset, memoryview(d.data), d.crc32c)
    return chunk


def encode_chunk(message: pb.ReplicaChunk | bytes) -> bytes:
    """The sender's serializer: data chunks come encoded (encode_data)."""
    return message if isinstance(message, bytes) else message.SerializeToString()


__all__ = ["Data", "decode_chunk", "encode_chunk", "encode_data"]
