"""Data files of compressed checkpoints: not safetensors files, and saying so.

A checkpoint saved with compression="zstd" has data files named
`data-NNNNN.fpz` whose tensors are mostly compressed (manifest encoding
"zstd-bytegroup-v1"). Layout:

    8 bytes   MAGIC, b"\\x89FPZ\\r\\n\\x1a\\n"
    8 bytes   little-endian u64 N, the header length
    N bytes   JSON header, padded with spaces so that 16 + N is a multiple
              of 4096 (the data section starts aligned for direct I/O)
    data      each tensor's stored bytes back to back: raw ones first (larger
              elements first, so each sits at a multiple of its element size),
              then the compressed ones

The header is {"__metadata__": {...}, NAME: {"dtype", "shape", "data_offsets":
[begin, end] of its stored bytes in the data section, "encoding"}}; the
manifest holds the frame index. Read as safetensors, the magic is a header
length of about 2**59 bytes, which safetensors refuses at once ("header too
large") instead of taking compressed bytes for tensors.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ..knobs import ALIGNMENT
from . import safetensors_file
from .safetensors_file import HeaderError, Layout, ParsedEntry

MAGIC = b"\x89FPZ\r\n\x1a\n"
FORMAT = "fastpersist-packed-v1"
SUFFIX = ".fpz"
_PREFIX = len(MAGIC) + 8


@dataclass(frozen=True)
class PackedEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    stored: int  # bytes in the data section
    encoding: str


def is_packed(prefix: bytes) -> bool:
    return prefix[:len(MAGIC)] == MAGIC


def layout(entries: Sequence[PackedEntry], metadata: dict[str, str]) -> Layout:
    """Place entries in the order given and build the header."""
    header: dict[str, object] = {"__metadata__": {**metadata, "format": FORMAT}}
    offsets = []
    cursor = 0
    for e in entries:
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape),
                          "data_offsets": [cursor, cursor + e.stored], "encoding": e.encoding}
        offsets.append(cursor)
        cursor += e.stored
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    padded_len = -(-(_PREFIX + len(text)) // ALIGNMENT) * ALIGNMENT - _PREFIX
    if padded_len > safetensors_file.MAX_HEADER_BYTES - 8:
        raise ValueError(f"the data file's header would be {padded_len} bytes, more than "
                         f"readers accept")
    blob = MAGIC + struct.pack("<Q", padded_len) + text + b" " * (padded_len - len(text))
    data_start = len(blob)
    return Layout(header=blob, data_start=data_start,
                  offsets=tuple(data_start + o for o in offsets), size=data_start + cursor)


def parse_header(prefix: bytes) -> tuple[int, dict[str, ParsedEntry], dict[str, str]]:
    """As safetensors_file.parse_header, for a packed file's first bytes.
    Each entry's begin..end are its stored bytes; `encoding` is the header's."""
    if not is_packed(prefix):
        raise HeaderError("not a packed data file (no magic)")
    data_start, entries, metadata = safetensors_file.parse_header(prefix[len(MAGIC):],
                                                                  encodings=True)
    return data_start + len(MAGIC), entries, metadata
