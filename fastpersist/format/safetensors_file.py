"""Data files: safetensors files whose data section starts on a 4 KiB boundary.

Layout (https://github.com/huggingface/safetensors, "Format"):
    8 bytes   little-endian u64 N, the header length
    N bytes   JSON header, padded here with spaces so that 8 + N is a
              multiple of 4096: the data section then starts aligned, which
              is what direct I/O needs, and safetensors accepts the padding
    data      tensors back to back, no gaps (safetensors rejects holes)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..knobs import ALIGNMENT
from . import dtypes

try:
    from .. import _format
except ImportError:  # no C extension: the headers are written in Python
    _format = None  # type: ignore[assignment]

MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# The "__metadata__" of every data file fastpersist writes, raw or packed.
DATA_FILE_METADATA = {"format": "pt", "producer": "fastpersist"}


class HeaderEntry(NamedTuple):  # a tuple: a file may hold 100,000 of them
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class Layout:
    header: bytes  # the 8-byte length and the padded JSON
    data_start: int  # file offset of the data section
    offsets: tuple[int, ...]  # file offset of each entry, in the order given
    size: int  # file size


def layout(entries: Sequence[HeaderEntry], metadata: dict[str, str]) -> Layout:
    """Place entries in the data section in the order given and build the header."""
    offsets = []
    cursor = 0
    for e in entries:
        offsets.append(cursor)
        cursor += e.nbytes
    names = {e.name for e in entries}
    if len(names) == len(entries) and "__metadata__" not in names:
        text = header_json(entries, metadata)
    else:  # a name twice or "__metadata__": the dict's rules decide what the header says
        header: dict[str, object] = {"__metadata__": metadata}
        for e, off in zip(entries, offsets, strict=True):
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape),
                              "data_offsets": [off, off + e.nbytes]}
        text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    blob = padded(text)
    data_start = len(blob)
    return Layout(
        header=blob,
        data_start=data_start,
        offsets=tuple(data_start + o for o in offsets),
        size=data_start + cursor,
    )


_string = json.encoder.encode_basestring  # what ensure_ascii=False uses


def header_json(entries: Iterable[tuple[str, str, Sequence[int], int]],
                metadata: dict[str, str]) -> bytes:
    """The header's JSON for (name, dtype, shape, nbytes) entries placed back to
    back in the order given: json.dumps(header, separators=(",", ":"),
    ensure_ascii=False) of layout()'s dict, byte for byte, without building it.
    The names must be unique and none "__metadata__" (layout() checks)."""
    prefix = '{"__metadata__":' + json.dumps(metadata, separators=(",", ":"), ensure_ascii=False)
    if _format is not None:  # the same bytes, from C, where names need no escapes
        if not isinstance(entries, list | tuple):
            entries = list(entries)
        made = _format.header_json(entries, prefix.encode())
        if made is not None:
            return made
    parts = [prefix]
    dtype_json: dict[str, str] = {}
    dims_json: dict[tuple[int, ...], str] = {}  # states repeat a few shapes many times
    cursor = 0
    for name, dtype, shape, nbytes in entries:
        text = dtype_json.get(dtype) or dtype_json.setdefault(dtype, _string(dtype))
        key = tuple(shape)
        dims = dims_json.get(key)
        if dims is None:
            dims = dims_json[key] = ",".join(map(str, map(int, shape)))
        end = cursor + nbytes
        parts.append(f',{_string(name)}:{{"dtype":{text},"shape":[{dims}],'
                     f'"data_offsets":[{cursor:d},{end:d}]}}')
        cursor = end
    parts.append("}")
    return "".join(parts).encode()


def padded(text: bytes) -> bytes:
    """The header as the file holds it: the 8-byte length, the JSON, and spaces
    up to the next multiple of ALIGNMENT."""
    padded_len = -(-(8 + len(text)) // ALIGNMENT) * ALIGNMENT - 8
    return struct.pack("<Q", padded_len) + text + b" " * (padded_len - len(text))


class ParsedEntry(NamedTuple):  # a tuple: every load parses every entry of a header
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets within the data section
    end: int
    encoding: str = "raw"  # packed_file.py's headers say; safetensors' are raw


class HeaderError(ValueError):
    """The bytes are not a valid safetensors header."""


def parse_header(prefix: bytes, *, encodings: bool = False
                 ) -> tuple[int, dict[str, ParsedEntry], dict[str, str]]:
    """Parse a header from the first bytes of a file.

    Returns (data_start, entries by name, metadata). `prefix` must hold at
    least 8 bytes plus the header; HeaderError says what is wrong otherwise.
    With `encodings` (packed_file.py's headers), every entry must also carry
    an "encoding" string.
    """
    if len(prefix) < 8:
        raise HeaderError(f"file is {len(prefix)} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"header length {n} is larger than the {MAX_HEADER_BYTES}-byte limit")
    if len(prefix) < 8 + n:
        raise HeaderError(f"header needs {8 + n} bytes but only {len(prefix)} are present")
    try:
        raw = json.loads(prefix[8 : 8 + n].decode("utf-8"), parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, NaN, too deep
        raise HeaderError(f"header is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise HeaderError("header is not a JSON object")
    metadata = raw.pop("__metadata__", {}) or {}
    entries: dict[str, ParsedEntry] = {}
    for name, info in raw.items():
        try:
            dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError):
            raise HeaderError(f"header entry {name!r} is malformed") from None
        # type() is int: JSON integers, not bools (nor floats or strings)
        if (type(shape) is not list or not all(type(d) is int for d in shape)
                or type(offsets) is not list or len(offsets) != 2
                or type(offsets[0]) is not int or type(offsets[1]) is not int):
            raise HeaderError(f"header entry {name!r} is malformed")
        if not isinstance(dtype, str) or dtype not in dtypes.SUPPORTED_NAMES:
            raise HeaderError(f"header entry {name!r} has unknown dtype {dtype!r}")
        if any(d < 0 for d in shape):
            raise HeaderError(f"header entry {name!r} has a negative dimension {shape}")
        begin, end = offsets
        if not 0 <= begin <= end:
            raise HeaderError(f"header entry {name!r} has data_offsets {begin}..{end}")
        encoding = info.get("encoding") if encodings else "raw"
        if not isinstance(encoding, str):
            raise HeaderError(f"header entry {name!r} has no encoding")
        entries[name] = ParsedEntry(name, dtype, tuple(shape), begin, end, encoding)
    return 8 + n, entries, metadata


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not allowed")
