"""Two byte strings as one message of the coordinator's gather_bytes and
gather_bytes_from (phases.py): the first's length, then both. Rank 0 reads
a message back as two views of it, so that what the ranks sent is copied no
further (table.BoxTable, written.Written). A leaf module, torch-free."""

from __future__ import annotations

import struct

_LENGTH = struct.Struct("<Q")  # the first's length, before both


def paired(first: bytes | memoryview, second: bytes | memoryview) -> bytes:
    """The message of `first` and `second`."""
    return b"".join((_LENGTH.pack(len(first)), first, second))


def unpaired(message: object) -> tuple[memoryview, memoryview] | None:
    """The two parts of a message paired() made, as views of it; None where
    `message` is no such message (too short, or not bytes)."""
    if not isinstance(message, bytes) or len(message) < _LENGTH.size:
        return None
    view = memoryview(message)
    (n,) = _LENGTH.unpack_from(view)
    if n > len(view) - _LENGTH.size:
        return None
    return view[_LENGTH.size:_LENGTH.size + n], view[_LENGTH.size + n:]


__all__ = ["paired", "unpaired"]
