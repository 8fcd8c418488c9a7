"""One frame: a run of a tensor's raw bytes <-> its stored bytes.

Stored form of a frame (little-endian), covered as a whole by the frame's
CRC32C in the manifest:

    kind 0 (stored):  u8 0, then the raw bytes as they are
    kind 1 (grouped): u8 1, u8 rotate (0/1), u8 unit (1, 2, 4 or 8 planes),
                      per plane: u8 mode (0 raw, 1 zstd) and u32 length,
                      then each plane's bytes in order

A plane holds byte j of every unit of the frame (planes.py); a zstd plane is
one zstd frame with its content size. Float planes are written by the C
extension's encoder of Huffman-coded literals (csrc/codec/fpc_zstd_literals.c:
zstd frames without matches, twice as fast to write as zstd's own fastest
level on these bytes, and smaller); integer planes, which may repeat, by
zstd's library. Any zstd decoder reads both. A frame that would not get smaller is
stored (kind 0), so stored bytes never exceed raw bytes by more than
format.frames.MAX_FRAME_OVERHEAD. Decoding checks every length against what
the frame must hold and raises CodecError on anything else: a decoder fed
hostile bytes fails, it never allocates what a header claims or returns
short data.
"""

from __future__ import annotations

import struct
import threading

import numpy as np
import zstandard

from .planes import Grouping, merge, split

KIND_STORED = 0
KIND_GROUPED = 1
MODE_RAW = 0
MODE_ZSTD = 1
_HEAD = struct.Struct("<BBB")
_PLANE = struct.Struct("<BI")

# A plane whose first SAMPLE bytes do not compress below SKIP_RATIO of their
# size is stored raw without compressing the rest: the low mantissa bytes of
# trained weights are random, and trying them costs as much as the rest.
SAMPLE = 64 << 10
SKIP_RATIO = 0.98

# zstd "fast" with a small hash table and the longest minimum match: the
# exponent plane is mostly literals for the Huffman stage, and short matches
# cost more than they save there (measured against levels 1, 3 and 9 on
# trained weights and Adam moments: benchmarks/codec.py).
_PARAMS = zstandard.ZstdCompressionParameters(
    window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0,
    strategy=zstandard.STRATEGY_FAST, write_content_size=True, write_checksum=False,
    write_dict_id=False)


try:
    from .. import _codec
except ImportError:  # no C extension: numpy planes and zstd's library, the same format
    _codec = None  # type: ignore[assignment]


class CodecError(ValueError):
    """Stored bytes that are not a frame of the expected kind and size."""


_local = threading.local()  # zstd contexts are not shared between threads


def _compressor() -> zstandard.ZstdCompressor:
    c: zstandard.ZstdCompressor | None = getattr(_local, "c", None)
    if c is None:
        c = _local.c = zstandard.ZstdCompressor(compression_params=_PARAMS)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d: zstandard.ZstdDecompressor | None = getattr(_local, "d", None)
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _scratch(n: int) -> memoryview:
    """A buffer of n bytes this thread reuses (fresh memory costs page faults)."""
    buf: bytearray | None = getattr(_local, "scratch", None)
    if buf is None or len(buf) < n:
        buf = _local.scratch = bytearray(n)
    return memoryview(buf)[:n]


def _split(raw: memoryview, g: Grouping) -> list[memoryview]:
    """raw's planes; they live in this thread's scratch until the next call."""
    if _codec is None:
        return [memoryview(row).cast("B") for row in split(raw, g)]
    buf = _scratch(len(raw))
    _codec.split(raw, g.unit, g.rotate, buf)
    n = len(raw) // g.unit
    return [buf[j * n:(j + 1) * n] for j in range(g.unit)]


def _plane(plane: memoryview, floats: bool) -> tuple[int, bytes | memoryview]:
    if floats and _codec is not None:
        coded = _codec.zstd_literals(plane)
        if isinstance(coded, bytes):
            return MODE_ZSTD, coded
        if coded == _codec.NOT_SMALLER:
            return MODE_RAW, plane
        # UNSUPPORTED (a table it cannot write): zstd's library does it.
    c = _compressor()
    if len(plane) >= 2 * SAMPLE and len(c.compress(plane[:SAMPLE])) > SKIP_RATIO * SAMPLE:
        return MODE_RAW, plane
    packed = c.compress(plane)
    return (MODE_ZSTD, packed) if len(packed) < len(plane) else (MODE_RAW, plane)


def encode(raw: memoryview, g: Grouping) -> bytes:
    """The stored form of `raw`, whose length is a multiple of g.unit."""
    modes, parts = [], []
    for row in _split(raw, g):
        mode, part = _plane(row, g.floats)
        modes.append(mode)
        parts.append(part)
    head = _HEAD.pack(KIND_GROUPED, int(g.rotate), g.unit) + b"".join(
        _PLANE.pack(m, len(p)) for m, p in zip(modes, parts, strict=True))
    if len(head) + sum(len(p) for p in parts) > len(raw):
        return bytes([KIND_STORED]) + raw
    return b"".join([head, *parts])


def decode(stored: memoryview, g: Grouping, out: memoryview) -> None:
    """Decode one stored frame into `out` (exactly the frame's raw length)."""
    raw_len = len(out)
    if len(stored) < 1:
        raise CodecError("empty frame")
    kind = stored[0]
    if kind == KIND_STORED:
        if len(stored) != raw_len + 1:
            raise CodecError(f"stored frame holds {len(stored) - 1} bytes, expected {raw_len}")
        out[:] = stored[1:]
        return
    if kind != KIND_GROUPED:
        raise CodecError(f"unknown frame kind {kind}")
    if len(stored) < _HEAD.size:
        raise CodecError("frame header is cut short")
    _, rotate, unit = _HEAD.unpack_from(stored)
    if (unit, bool(rotate)) != (g.unit, g.rotate) or rotate > 1:
        raise CodecError(f"frame of {unit}-byte units (rotate {rotate}), expected "
                         f"{g.unit} (rotate {int(g.rotate)})")
    if raw_len % unit:
        raise CodecError(f"{raw_len} bytes are not whole {unit}-byte units")
    n = raw_len // unit
    pos = _HEAD.size + unit * _PLANE.size
    if len(stored) < pos:
        raise CodecError("frame header is cut short")
    planes: list[bytes | memoryview] = []
    for j in range(unit):
        mode, length = _PLANE.unpack_from(stored, _HEAD.size + j * _PLANE.size)
        part = stored[pos:pos + length]
        if len(part) != length:
            raise CodecError(f"plane {j} runs past the frame's end")
        pos += length
        if mode == MODE_RAW:
            if length != n:
                raise CodecError(f"raw plane {j} holds {length} bytes, expected {n}")
            planes.append(part)
        elif mode == MODE_ZSTD:
            planes.append(_unzstd(part, n, j))
        else:
            raise CodecError(f"plane {j} has unknown mode {mode}")
    if pos != len(stored):
        raise CodecError(f"{len(stored) - pos} bytes after the frame's last plane")
    if _codec is None:
        merge([np.frombuffer(p, dtype=np.uint8) for p in planes], g, out)
    else:
        _codec.merge(planes, g.unit, g.rotate, out)


def _unzstd(part: memoryview, n: int, j: int) -> bytes:
    # The content size is checked before anything is allocated for it.
    try:
        size = zstandard.frame_content_size(part)
    except zstandard.ZstdError as exc:
        raise CodecError(f"plane {j}: {exc}") from None
    if size != n:
        raise CodecError(f"plane {j} holds {size} bytes, expected {n}")
    try:
        data = _decompressor().decompress(part, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise CodecError(f"plane {j}: {exc}") from None
    if len(data) != n:
        raise CodecError(f"plane {j} decoded to {len(data)} bytes, expected {n}")
    return data
