"""Arbitrary inputs straight into the C extensions' entry points (csrc/format,
csrc/codec): whatever the bytes, sizes and offsets, each call returns an
answer or raises an ordinary Python error, never reads or writes outside its
buffers. Run under AddressSanitizer and UBSan by scripts/sanitize.sh (which
also runs the engine, codec, scanner and manifest fuzz tests), where an
out-of-bounds access or undefined behaviour aborts the run; in the normal
suite they check the answers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from fastpersist.format import bounds, dtypes
from fastpersist.format.records import TensorRecord

_format = pytest.importorskip("fastpersist._format")
_codec = pytest.importorskip("fastpersist._codec")

LIMITS = (bounds.MAX_DIMS, bounds.MAX_ELEMENTS, bounds.MAX_FILE_BYTES, bounds.CRC_MAX)
ITEMSIZES = {name: dtypes.itemsize(name) for name in ("F32", "BF16", "I64", "U8", "BOOL")}
RECORD = (b'{"name":"w%d","file":"data-00000.safetensors","offset":%d,"length":%d,'
          b'"dtype":"F32","shape":[%d],"crc32c":%d}')


def records_text(n: int) -> bytes:
    return b",\n  ".join(RECORD % (i, 4096 + 64 * i, 64, 16, i) for i in range(n))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_scan_records_on_arbitrary_bytes_and_bounds(data: st.DataObject) -> None:
    base = bytearray(records_text(data.draw(st.integers(0, 6), label="records")))
    for _ in range(data.draw(st.integers(0, 4), label="edits")):
        if not base:
            break
        at = data.draw(st.integers(0, len(base) - 1), label="at")
        base[at] = data.draw(st.integers(0, 255), label="byte")
    if data.draw(st.booleans(), label="garbage"):
        base = bytearray(data.draw(st.binary(max_size=300), label="bytes"))
    text = bytes(base)
    # Bounds inside, at and past the ends, and reversed.
    start = data.draw(st.integers(-5, len(text) + 5), label="start")
    stop = data.draw(st.integers(-5, len(text) + 5), label="stop")
    files = {"data-00000.safetensors": (4096, 1 << 20, 0)}
    try:
        out = _format.scan_records(text, start, stop, files, ITEMSIZES, TensorRecord, "raw",
                                   LIMITS)
    except (ValueError, TypeError, OverflowError, IndexError):
        return
    assert out is None or isinstance(out, list)


@settings(max_examples=100, deadline=None)
@given(names=st.lists(st.text(max_size=40), max_size=8),
       dims=st.lists(st.lists(st.integers(0, 1 << 40), max_size=5), min_size=8, max_size=8),
       nbytes=st.lists(st.integers(0, 1 << 62), min_size=8, max_size=8),
       prefix=st.binary(max_size=64))
def test_header_json_on_arbitrary_entries(names: list[str], dims: list[list[int]],
                                          nbytes: list[int], prefix: bytes) -> None:
    entries = [(n, "F32", d, b) for n, d, b in zip(names, dims, nbytes, strict=False)]
    try:
        out = _format.header_json(entries, prefix)
    except (ValueError, TypeError, OverflowError, UnicodeError):
        return
    if out is None:  # names that need escapes: the Python writer's job
        return
    if prefix == b'{"__metadata__":{}':
        header = json.loads(out + b"}")
        assert [k for k in header if k != "__metadata__"] == [e[0] for e in entries]


UNITS = [1, 2, 4, 8]


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=4096), unit=st.sampled_from(UNITS), rotate=st.booleans(),
       out_extra=st.integers(-8, 8))
def test_split_and_merge_on_arbitrary_sizes(raw: bytes, unit: int, rotate: bool,
                                            out_extra: int) -> None:
    out = bytearray(max(len(raw) + out_extra, 0))
    try:
        _codec.split(raw, unit, rotate, out)
    except (ValueError, TypeError):
        assert out_extra != 0 or len(raw) % unit != 0 or (rotate and unit == 1)
        return
    n = len(raw) // unit
    planes = [bytes(out[i * n:(i + 1) * n]) for i in range(unit)]
    back = bytearray(len(raw))
    _codec.merge(planes, unit, rotate, back)
    assert bytes(back) == raw


@settings(max_examples=150, deadline=None)
@given(plane=st.one_of(st.binary(max_size=1 << 14),
                       st.builds(lambda seed, n: np.random.default_rng(seed).integers(
                           0, 8, n, dtype=np.uint8).tobytes(),
                           st.integers(0, 99), st.integers(0, 1 << 16))))
def test_zstd_literals_frames_decode_to_their_input(plane: bytes) -> None:
    out = _codec.zstd_literals(plane)
    if isinstance(out, int):  # NOT_SMALLER or UNSUPPORTED: the library's job
        assert out in (_codec.NOT_SMALLER, _codec.UNSUPPORTED)
        return
    assert zstandard.ZstdDecompressor().decompress(out, max_output_size=len(plane) + 1) == plane


def test_merge_refuses_planes_of_unequal_sizes() -> None:
    with pytest.raises((ValueError, TypeError)):
        _codec.merge([b"ab", b"abc"], 2, False, bytearray(5))


def test_header_json_of_nothing_with_an_empty_prefix() -> None:
    """Once undefined (memcpy into a buffer not yet allocated, found by UBSan
    through the fuzz pass above): an empty prefix and no entries."""
    assert _format.header_json([], b"") == b"}"
    assert _format.header_json([("w", "F32", [2], 8)], b"") == (
        b',"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}')
