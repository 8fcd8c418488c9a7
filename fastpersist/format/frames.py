"""The frame index of a compressed tensor record, parsed and checked.

A record with encoding "zstd-bytegroup-v1" stores its tensor as frames
(fastpersist/codec/): its raw bytes cut into runs of at most MAX_FRAME_BYTES,
each encoded on its own. Its `offset` is where its stored bytes start in the
file, `stored_length` how many there are, `length` and `crc32c` are still
those of the raw bytes, and `frames` lists, per frame,

    [raw_offset, raw_length, stored_offset, stored_length, crc32c]

offsets relative to the tensor's first raw and first stored byte, and the
CRC32C of the frame's stored bytes. The frames tile both the raw bytes
(0..length) and the stored bytes (0..stored_length) in order, without gap or
overlap, so a reader may trust that decoding frame i fills exactly its raw
run from exactly its stored run. Torch-free.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .bounds import (
    CRC_MAX,
    MAX_FILE_BYTES,
    MAX_FRAME_BYTES,
    MAX_FRAME_OVERHEAD,
    MIN_FRAME_BYTES,
    is_int,
    malformed,
    short,
)

RAW = "raw"
ZSTD_BYTEGROUP = "zstd-bytegroup-v1"
ENCODINGS = frozenset({RAW, ZSTD_BYTEGROUP})
# Tensors smaller than this are stored raw in a packed file: a frame index
# costs more than compressing them saves.
MIN_ENCODED_BYTES = 4096


class Frame(NamedTuple):
    raw_offset: int
    raw_length: int
    stored_offset: int
    stored_length: int
    crc32c: int  # of the stored bytes


def max_frames(length: int) -> int:
    """The most frames a tensor of `length` raw bytes may have."""
    return -(-length // MIN_FRAME_BYTES)


def parse_frames(raw: Any, length: int, stored_length: int, itemsize: int, where: str,
                 ctx: object) -> tuple[Frame, ...]:
    """The frames of a record of `length` raw and `stored_length` stored bytes."""
    if not isinstance(raw, list):
        raise malformed(where, f"{ctx}: 'frames' must be a list")
    if len(raw) > max_frames(length):  # checked before any frame is looked at
        raise malformed(where, f"{ctx}: {len(raw)} frames for {length} bytes (at most "
                        f"{max_frames(length)})")
    frames = []
    raw_at = stored_at = 0
    for i, f in enumerate(raw):
        if not (isinstance(f, list) and len(f) == 5 and all(is_int(v) for v in f[:4])
                and is_int(f[4], 0, CRC_MAX)):
            raise malformed(where, f"{ctx}: frames[{i}] must be five integers >= 0 "
                            f"(raw offset, raw length, stored offset, stored length, "
                            f"CRC32C), not {short(f)}")
        fr = Frame(*f)
        if fr.raw_offset != raw_at or fr.stored_offset != stored_at:
            raise malformed(where, f"{ctx}: frames[{i}] starts at raw {fr.raw_offset}, "
                            f"stored {fr.stored_offset}; the frames must tile the bytes "
                            f"in order (expected {raw_at}, {stored_at})")
        if not 0 < fr.raw_length <= MAX_FRAME_BYTES or fr.raw_length % itemsize:
            raise malformed(where, f"{ctx}: frames[{i}] has {fr.raw_length} raw bytes "
                            f"(whole elements, 1 to {MAX_FRAME_BYTES})")
        if not 0 < fr.stored_length <= fr.raw_length + MAX_FRAME_OVERHEAD:
            raise malformed(where, f"{ctx}: frames[{i}] has {fr.stored_length} stored bytes "
                            f"for {fr.raw_length} raw ones")
        raw_at += fr.raw_length
        stored_at += fr.stored_length
        if raw_at > length or stored_at > stored_length:
            raise malformed(where, f"{ctx}: frames[{i}] ends past the tensor's {length} raw "
                            f"or {stored_length} stored bytes")
        frames.append(fr)
    if (raw_at, stored_at) != (length, stored_length):
        raise malformed(where, f"{ctx}: the frames cover {raw_at} raw and {stored_at} stored "
                        f"bytes, the record {length} and {stored_length}")
    return tuple(frames)


def check_stored_length(value: Any, where: str, ctx: object) -> int:
    if not is_int(value, 0, MAX_FILE_BYTES):
        raise malformed(where, f"{ctx}: 'stored_length' must be an integer from 0 to "
                        f"{MAX_FILE_BYTES}, not {short(value)}")
    return value


def frames_to_json(frames: tuple[Frame, ...]) -> list[list[int]]:
    return [list(f) for f in frames]
